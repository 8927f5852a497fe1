"""An emulated wide-area link, applied in our own transport: bandwidth and latency per peer.

`tc netem` is not available on the machines we test on, so a trainer can slow its own calls
instead: each peer gets a link of `bandwidth_mbit` in each direction, shared by every call in
flight to that peer (a message waits for the ones ahead of it), plus `latency_ms` one way. Used by
tests and benchmarks to study compression and routing on 127.0.0.1; off (None) in real runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkShape:
    """One emulated link: bandwidth in each direction (0: unlimited) and one-way latency."""

    bandwidth_mbit: float = 0.0
    latency_ms: float = 0.0

    def transmit_seconds(self, num_bytes: int) -> float:
        return num_bytes * 8 / (self.bandwidth_mbit * 1e6) if self.bandwidth_mbit > 0 else 0.0


class LinkShaper:
    """Delays messages as a link of the given shape to every peer would."""

    def __init__(self, shape: LinkShape) -> None:
        self.shape = shape
        self._busy_until: dict[tuple[str, str], float] = defaultdict(float)

    def delay(self, peer: str, direction: str, num_bytes: int, now: float | None = None) -> float:
        """Seconds until `num_bytes` sent now in `direction` ("up" or "down") have arrived at the other end."""
        now = time.monotonic() if now is None else now
        key = (peer, direction)
        start = max(now, self._busy_until[key])
        self._busy_until[key] = start + self.shape.transmit_seconds(num_bytes)
        return self._busy_until[key] + self.shape.latency_ms / 1000 - now

    async def send(self, peer: str, num_bytes: int) -> None:
        """Waits as long as a request of `num_bytes` takes to reach `peer`."""
        await asyncio.sleep(self.delay(peer, "up", num_bytes))

    async def receive(self, peer: str, num_bytes: int) -> None:
        """Waits as long as a reply of `num_bytes` takes to come back from `peer`."""
        await asyncio.sleep(self.delay(peer, "down", num_bytes))
