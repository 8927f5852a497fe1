"""Notice of an imminent preemption, from the cloud's metadata service or a file.

Spot and preemptible instances are warned before they are taken away: AWS about two minutes
ahead (`spot/instance-action` in the instance metadata), GCP about thirty seconds ahead (the
`preempted` flag). A peer polls its source and, on notice, leaves as on SIGTERM: it stops taking
work, hands its gradients to its stage-mates, withdraws its record and saves its checkpoint.
The `file:PATH` source gives notice when PATH exists, for tests and for other schedulers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from swarm.config.preemption_flag import parse_notice_source

logger = logging.getLogger(__name__)

# The metadata services' base URLs; the variables (shared with scripts/spot/swarm-peer.sh) point
# them elsewhere, e.g. at a stand-in service in tests.
AWS_METADATA_URL_ENV, AWS_METADATA_URL = "SWARM_AWS_METADATA_URL", "http://169.254.169.254"
GCP_METADATA_URL_ENV, GCP_METADATA_URL = "SWARM_GCP_METADATA_URL", "http://metadata.google.internal"
AWS_TOKEN_PATH = "/latest/api/token"
AWS_NOTICE_PATH = "/latest/meta-data/spot/instance-action"
GCP_NOTICE_PATH = "/computeMetadata/v1/instance/preempted"
METADATA_TIMEOUT = 2.0


def _aws_url(path: str) -> str:
    return os.environ.get(AWS_METADATA_URL_ENV, AWS_METADATA_URL).rstrip("/") + path


def _gcp_url(path: str) -> str:
    return os.environ.get(GCP_METADATA_URL_ENV, GCP_METADATA_URL).rstrip("/") + path


def _aws_notice() -> bool:
    """Whether AWS has scheduled this spot instance's interruption (IMDSv2, then v1)."""
    headers = {}
    try:
        token_request = urllib.request.Request(
            _aws_url(AWS_TOKEN_PATH), method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
        )
        with urllib.request.urlopen(token_request, timeout=METADATA_TIMEOUT) as reply:
            headers["X-aws-ec2-metadata-token"] = reply.read().decode()
    except (urllib.error.URLError, OSError):
        pass  # IMDSv1, or no metadata service at all: the notice request below says which
    try:
        with urllib.request.urlopen(
            urllib.request.Request(_aws_url(AWS_NOTICE_PATH), headers=headers), timeout=METADATA_TIMEOUT
        ) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):  # HTTPError 404 included: no interruption scheduled
        return False


def _gcp_notice() -> bool:
    """Whether GCP has started preempting this instance."""
    request = urllib.request.Request(_gcp_url(GCP_NOTICE_PATH), headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT) as reply:
            return reply.read().decode().strip().upper() == "TRUE"
    except (urllib.error.URLError, OSError):
        return False


def notice_source(spec: str) -> Callable[[], bool] | None:
    """The check named by --preemption-notice: none, aws, gcp or file:PATH (PreemptionSourceError if none of them)."""
    source = parse_notice_source(spec)
    if isinstance(source, Path):
        return source.exists
    return {None: None, "aws": _aws_notice, "gcp": _gcp_notice}[source]


async def watch_for_preemption(check: Callable[[], bool], period: float, stop: asyncio.Event) -> None:
    """Polls `check` every `period` seconds (off the event loop) and sets `stop` on notice."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            if await loop.run_in_executor(None, check):
                logger.warning("Preemption notice received: leaving the swarm")
                stop.set()
                return
        except Exception as e:  # a broken source must not take the peer down
            logger.debug(f"Preemption check failed: {e}")
        await asyncio.sleep(period)
