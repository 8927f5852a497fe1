"""How many microbatches a trainer keeps in flight: sized from what the pipeline delivers.

A pipeline of stages behind slow links holds as many microbatches as its delivery rate times a
microbatch's round trip when nothing queues (Little's law: the bandwidth-delay product). Fewer leave
links and stages idle; more only queue at the slowest one. `InFlightWindow` estimates both from the
microbatches the trainer completes, as BBR does for a TCP flow: the round trip is the smallest seen
(queueing only ever adds to it), the rate the highest of the recent estimates, and the window `gain`
times their product. Each completed microbatch gives one estimate of the rate: the samples delivered
while it was in flight, over its round trip. (An average over the last completions, as it was once
taken, spans less than a round trip once the window holds more than twice as many: it then stopped
giving estimates, and the window froze.) While the window is what holds the rate back, each round trip
grows it by about `gain`; once the slowest link or stage is busy, the rate stops growing and so does
the window, with about one product's worth queued in front of that bottleneck. The smallest round trip
is kept for the whole run: a minimum that expired under a standing queue would come back higher each
time and the window would run away to its ceiling. `InFlightGate` admits microbatches up to the window.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from types import TracebackType


class InFlightWindow:
    """The trainer's estimate of the microbatches the pipeline holds; pure, fed completed microbatches."""

    def __init__(
        self,
        initial: int,
        maximum: int,
        microbatch_samples: int,
        minimum: int = 1,
        gain: float = 2.0,
        memory: int = 256,
    ) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError(f"the window's bounds must satisfy 1 <= minimum <= maximum, got {minimum}, {maximum}")
        self.minimum, self.maximum = minimum, maximum
        self.microbatch_samples = max(1, microbatch_samples)
        self.gain = gain
        self.size = self._bounded(initial)
        self.largest = self.size
        self._rates: deque[float] = deque(maxlen=memory)  # samples/s delivered, per recent estimate
        self.delivered = 0  # samples completed so far: what a microbatch notes as it goes out
        self.rate = 0.0  # samples/s: the highest recent estimate
        self.round_trip = math.inf  # seconds: the smallest round trip of one microbatch seen

    def completed(self, samples: int, round_trip: float, delivered_at_send: int) -> int:
        """One microbatch of `samples` came back `round_trip` seconds after it went out, when `delivered`
        was `delivered_at_send`; returns the window."""
        round_trip = max(round_trip, 1e-6)
        self.round_trip = min(self.round_trip, round_trip)
        self.delivered += samples
        self._rates.append((self.delivered - delivered_at_send) / round_trip)
        self.rate = max(self._rates)
        size = self._bounded(self.gain * self.rate * self.round_trip / self.microbatch_samples)
        # the first flight (sent before anything came back) counts too, but only to raise the window: what came
        # back of it so far is a rate the pipeline held at least, an understatement until all of it is back
        self.size = max(self.size, size) if delivered_at_send == 0 else size
        self.largest = max(self.largest, self.size)
        return self.size

    def _bounded(self, microbatches: float) -> int:
        return min(self.maximum, max(self.minimum, math.ceil(microbatches)))


class InFlightGate:
    """Admits microbatches while fewer than the window's size are in flight; `async with gate:` one each.

    Each microbatch that leaves the gate updates the window with its round trip. A fixed gate (window
    None) admits `limit` at a time, as a semaphore would.
    """

    def __init__(self, limit: int, window: InFlightWindow | None = None) -> None:
        self.window = window
        self.limit = limit
        self.in_flight = 0
        self._changed = asyncio.Condition()

    def _room(self) -> bool:
        return self.in_flight < (self.window.size if self.window is not None else self.limit)

    async def __aenter__(self) -> tuple[float, int]:
        """Waits for room; returns what `completed` takes back: when it went out, and the samples delivered."""
        async with self._changed:
            await self._changed.wait_for(self._room)
            self.in_flight += 1
        return time.monotonic(), (self.window.delivered if self.window is not None else 0)

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()

    def completed(self, samples: int, sent: tuple[float, int]) -> None:
        """A microbatch that went out at `sent` (what entering the gate returned) finished: it feeds the window."""
        if self.window is not None:
            sent_at, delivered_at_send = sent
            self.window.completed(samples, time.monotonic() - sent_at, delivered_at_send)
