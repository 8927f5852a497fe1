"""Deterministic fault injection for tests: a peer that fails at a named point, on a named hit.

`--faults` takes comma-separated entries `POINT[@N]=ACTION[:ARG]`:
- POINT is one of `POINTS`: where in the peer's work the fault strikes;
- `@N` makes it strike only the N-th time the point is reached (counting from 1); without it,
  every time;
- ACTION is `die` (the whole process group is SIGKILLed on the spot, daemons included: a machine
  that vanishes), `drop_reply` (the work is done but the caller gets no answer, as when a reply is
  lost on the way), `delay:SECONDS` (the point is held up that long), `perturb` (at `after_step`
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
from dataclasses import dataclass

logger = logging.getLogger(__name__)

POINTS = {
    "before_commit": "a backward was computed, before its gradient is added to the step's (runtime thread)",
    "after_backward": "a backward was applied (its samples accumulated, the mates told), before the reply is sent",
    "progress": "before this peer sends its progress to a mate",
    "before_contribution": "an averaging round starts, before this peer sends its gradients to its mates",
    "after_contribution": "this peer's gradients went out, before it commits to the round",
    "after_step": "the stage has stepped",
    "reply": "a forward or backward was computed, before its reply is encoded",
}
ACTIONS = ("die", "drop_reply", "delay", "perturb", "nan")
ONLY_AT = {"perturb": "after_step", "nan": "reply"}  # actions that make sense at one point only


class FaultError(ValueError):
    """A --faults entry that does not parse."""


class DropReply(Exception):
    """Raised at a `drop_reply` fault: the handler closes the stream without answering."""


@dataclass(frozen=True)
class Fault:
    point: str
    action: str
    hit: int | None = None  # strike only at this hit of the point; None: every hit
    seconds: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    """Parses a --faults value; FaultError names what is wrong."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        where, sep, what = entry.partition("=")
        if not sep:
            raise FaultError(f"{entry!r}: expected POINT[@N]=ACTION")
        point, _, hit = where.partition("@")
        if point not in POINTS:
            raise FaultError(f"{entry!r}: unknown point {point!r}; points are {sorted(POINTS)}")
        action, _, argument = what.partition(":")
        if action not in ACTIONS:
            raise FaultError(f"{entry!r}: unknown action {action!r}; actions are {list(ACTIONS)}")
        try:
            number = int(hit) if hit else None
            seconds = float(argument) if action == "delay" else 0.0
        except ValueError:
            raise FaultError(f"{entry!r}: @N must be a whole number and delay's argument seconds") from None
        if number is not None and number < 1:
            raise FaultError(f"{entry!r}: hits count from 1")
        if action in ONLY_AT and point != ONLY_AT[action]:
            raise FaultError(f"{entry!r}: {action} applies at {ONLY_AT[action]} only")
        faults.append(Fault(point, action, number, seconds))
    return faults


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

    def hit_sync(self, point: str) -> None:
        """Reached `point` on a worker thread: dies or sleeps as planned (other actions do not apply there)."""
        for fault in self._strikes(point):
            logger.warning(f"Fault injected at {point} (hit {self.hits[point]}): {fault.action}")
            if fault.action == "die":
                os.killpg(os.getpgrp(), signal.SIGKILL)
            elif fault.action == "delay":
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
            elif fault.action in ONLY_AT:
                if act is not None:
                    await act()
            else:
                raise DropReply(point)
