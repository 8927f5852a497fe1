"""Spot availability traces (`time_ms,add|remove,node` lines) replayed as a live-peer count over time."""

from __future__ import annotations

import csv
from pathlib import Path


def read_trace(path: str | Path) -> list[tuple[int, str]]:
    """The trace's events as (milliseconds, "add" or "remove"), in time order; malformed lines are refused."""
    rows = []
    with open(path) as file:
        for number, row in enumerate(csv.reader(file), start=1):
            if not row:
                continue
            try:
                t, kind = int(row[0]), row[1].strip()
            except (ValueError, IndexError):
                raise ValueError(f"{path}:{number}: expected time_ms,add|remove,node, got {row}") from None
            if kind not in ("add", "remove"):
                raise ValueError(f"{path}:{number}: event must be add or remove, got {kind!r}")
            rows.append((t, kind))
    if not rows:
        raise ValueError(f"{path}: no events")
    return sorted(rows)


def live_peer_targets(path: str | Path, minutes: float, max_peers: int, min_peers: int = 1) -> list[tuple[float, int]]:
    """(seconds after start, live peers wanted) from a trace compressed into `minutes`.

    The trace's live node count is scaled so that its peak becomes `max_peers`, and never goes
    below `min_peers` (one per stage keeps a swarm alive). Only changes of the count are listed.
    """
    rows = read_trace(path)
    span = max(t for t, _ in rows) or 1
    live, peak, counts = 0, 0, []
    for t, kind in rows:
        live += 1 if kind == "add" else -1
        peak = max(peak, live)
        counts.append((t * minutes * 60 / span, live))
    targets: list[tuple[float, int]] = []
    for t, count in counts:
        wanted = max(min_peers, round(count * max_peers / max(peak, 1)))
        if targets and targets[-1][0] == t:
            targets[-1] = (t, wanted)  # events at the same moment: only where they end up counts
        elif not targets or targets[-1][1] != wanted:
            targets.append((t, wanted))
    return targets


def mean_live_peers(targets: list[tuple[float, int]], seconds: float) -> float:
    """The live-peer count of `targets` averaged over time from 0 to `seconds` (each holds until the next)."""
    if not targets or seconds <= 0:
        raise ValueError("need at least one target and a positive duration")
    total = 0.0
    ends = [t for t, _ in targets[1:]] + [seconds]
    for (start, count), end in zip(targets, ends):
        start, end = min(start, seconds), min(end, seconds)
        total += max(0.0, end - start) * count
    return total / seconds
