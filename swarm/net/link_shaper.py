"""An emulated wide-area link, applied in our own transport: bandwidth and latency per peer.

`tc netem` is not available on the machines we test on, so a trainer can slow its own calls
instead: each peer gets a link of `bandwidth_mbit` in each direction, shared by every call in
flight to that peer (a message waits for the ones ahead of it), plus `latency_ms` one way. With
`own_link`, the sender's own link has that bandwidth too, shared by its calls to every peer: a
message then waits for both queues, as a flow through two bottlenecks in a row is held to the slower
one. Used by tests and benchmarks to study compression and routing on 127.0.0.1; off (None) in real
runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkShape:
    """One emulated link: bandwidth in each direction (0: unlimited), one-way latency, and whether the sender's
    own link is capped at that bandwidth as well as each peer's."""

    bandwidth_mbit: float = 0.0
    latency_ms: float = 0.0
    own_link: bool = False

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
        # the sender's own link is keyed by no peer: every call queues on it
        keys = [(peer, direction), ("", direction)] if self.shape.own_link else [(peer, direction)]
        for key in keys:
            start = max(now, self._busy_until[key])
            self._busy_until[key] = start + self.shape.transmit_seconds(num_bytes)
        return max(self._busy_until[key] for key in keys) + self.shape.latency_ms / 1000 - now

    async def send(self, peer: str, num_bytes: int) -> None:
        """Waits as long as a request of `num_bytes` takes to reach `peer`."""
        await asyncio.sleep(self.delay(peer, "up", num_bytes))

    async def receive(self, peer: str, num_bytes: int) -> None:
        """Waits as long as a reply of `num_bytes` takes to come back from `peer`."""
        await asyncio.sleep(self.delay(peer, "down", num_bytes))


class SharedLink:
    """An emulated link whose transfers in flight share its rate equally, as TCP flows share a bottleneck.

    `transfer(n)` waits as long as n bytes take while the others in flight take their shares: four equal
    transfers started together all end after four transfers' time. For tests and benchmarks of how a sender
    schedules its transfers (`swarm.net.uplink_turns`).
    """

    def __init__(self, bandwidth_mbit: float) -> None:
        self.rate = bandwidth_mbit * 1e6 / 8  # bytes per second
        self._active: dict[int, list] = {}  # one [bytes left, future] per transfer in flight
        self._updated = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def transfer(self, num_bytes: int) -> None:
        """Waits until `num_bytes` have crossed the link, sharing it with the transfers in flight."""
        if self.rate <= 0 or num_bytes <= 0:
            return
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        done = loop.create_future()
        self._active[id(done)] = [float(num_bytes), done]
        self._schedule(loop)
        try:
            await done
        finally:
            if self._active.pop(id(done), None) is not None:  # cancelled: its share goes to the others
                self._advance(loop.time())
                self._schedule(loop)

    def _advance(self, now: float) -> None:
        if self._active:
            share = self.rate * (now - self._updated) / len(self._active)
            for entry in self._active.values():
                entry[0] -= share
        self._updated = now

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sets the timer for the next transfer to end, at the rate each gets now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._active:
            left = max(0.0, min(entry[0] for entry in self._active.values()))
            self._timer = loop.call_later(left * len(self._active) / self.rate, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._advance(loop.time())
        for key, (left, done) in list(self._active.items()):
            if left <= 1.0:  # a byte of rounding
                del self._active[key]
                if not done.done():
                    done.set_result(None)
        self._schedule(loop)
