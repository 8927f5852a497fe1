"""The values of `--preemption-notice`: where a spot interruption notice comes from.

`none`, `aws` (the instance metadata's `spot/instance-action`), `gcp` (the `preempted` flag) or
`file:PATH` (notice when PATH exists). Parsed here, below the peer, so that the peer's settings are
checked before anything starts; the peer's watch (`swarm.peer.preemption`) polls the source named.
"""

from __future__ import annotations

from pathlib import Path

SOURCES = ("aws", "gcp")  # besides none and file:PATH


class PreemptionSourceError(ValueError):
    """A --preemption-notice value that names no known source."""


def parse_notice_source(spec: str) -> str | Path | None:
    """The source --preemption-notice names: None for none, "aws" or "gcp", or the Path of file:PATH."""
    if spec in ("", "none"):
        return None
    if spec in SOURCES:
        return spec
    if spec.startswith("file:") and len(spec) > len("file:"):
        return Path(spec[len("file:") :])
    raise PreemptionSourceError(f"unknown preemption notice source {spec!r}: use none, aws, gcp or file:PATH")
