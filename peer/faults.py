"""Deterministic fault injection for tests: a peer that fails at a named point, on a named hit.

`--faults` takes comma-separated entries `POINT[@N]=ACTION[:ARG]` (parsed by `swarm.config.faults_flag`):
- POINT is one of `POINTS`: where in the peer's work the fault strikes;
- `@N` makes it strike only the N-th time the point is reached (counting from 1); without it,
  every time;
- ACTION is `die` (the whole process group is SIGKILLed on the spot, daemons included: a machine
  that vanishes), `drop_reply` (the work is done but the caller gets no answer, as when a reply is
  lost on the way), `delay:SECONDS` (the point is held up that long), `freeze:SECONDS` (the whole
  process stops answering that long while its libp2p daemon still takes calls, as a hung peer or one
  killed without its daemon), `perturb` (at `after_step`
  only: the parameters are nudged, a replica gone wrong that its mates must catch) or `nan` (at
  `reply` only: the reply's tensors are all NaN, a peer gone bad that its callers must catch).

For example `after_backward@3=drop_reply,progress=delay:2`. Tests use this instead of timing
signals against log lines: the fault happens at exactly the point named.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from swarm.config.faults_flag import ONLY_AT, Fault, parse_faults

logger = logging.getLogger(__name__)


class DropReply(Exception):
    """Raised at a `drop_reply` fault: the handler closes the stream without answering."""


class FaultPlan:
    """The faults a peer was started with; `hit` is called at each point and acts when one matches."""

    def __init__(self, text: str = "") -> None:
        self.faults = parse_faults(text)
        self.hits: Counter[str] = Counter()

    def _strikes(self, point: str) -> list[Fault]:
        if not self.faults:
            return []
        self.hits[point] += 1
        return [f for f in self.faults if f.point == point and f.hit in (None, self.hits[point])]

    def planned(self, point: str) -> bool:
        """Whether a fault is planned at `point` (some points change the work's order to be reached at all)."""
        return any(f.point == point for f in self.faults)

    def hit_sync(self, point: str) -> None:
        """Reached `point` on a worker thread: dies or sleeps as planned (other actions do not apply there)."""
        for fault in self._strikes(point):
            logger.warning(f"Fault injected at {point} (hit {self.hits[point]}): {fault.action}")
            if fault.action == "die":
                os.killpg(os.getpgrp(), signal.SIGKILL)
            elif fault.action in ("delay", "freeze"):
                time.sleep(fault.seconds)

    async def hit(self, point: str, act: Callable[[], Awaitable[None]] | None = None) -> None:
        """Reached `point` on the event loop: dies, raises DropReply, sleeps, or has `act` do the point's
        own action (`perturb`, `nan`), as planned."""
        for fault in self._strikes(point):
            logger.warning(f"Fault injected at {point} (hit {self.hits[point]}): {fault.action}")
            if fault.action == "die":
                os.killpg(os.getpgrp(), signal.SIGKILL)
            elif fault.action == "delay":
                await asyncio.sleep(fault.seconds)
            elif fault.action == "freeze":
                time.sleep(fault.seconds)  # blocks the event loop on purpose: nothing of this peer answers
            elif fault.action in ONLY_AT:
                if act is not None:
                    await act()
            else:
                raise DropReply(point)
