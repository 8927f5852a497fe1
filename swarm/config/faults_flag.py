"""The language of `--faults`: deterministic faults a peer is started with, for tests.

`--faults` takes comma-separated entries `POINT[@N]=ACTION[:ARG]`:
- POINT is one of `POINTS`: where in the peer's work the fault strikes;
- `@N` makes it strike only the N-th time the point is reached (counting from 1); without it,
  every time;
- ACTION is one of `ACTIONS`: `die`, `drop_reply`, `delay:SECONDS`, `freeze:SECONDS`, `perturb` (at
  `after_step` only) or `nan` (at `reply` only); what each does is the peer's (`swarm.peer.faults`).

For example `after_backward@3=drop_reply,progress=delay:2`. Parsed here, below the peer, so that
the peer's settings are checked before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass

POINTS = {
    "before_commit": "a backward was computed, before its gradient is added to the step's (runtime thread)",
    "after_backward": "a backward was applied (its samples accumulated, the mates told), before the reply is sent",
    "progress": "before this peer sends its progress to a mate",
    "before_contribution": (
        "an averaging round starts in which this peer holds samples, before it offers them to its mates"
    ),
    "after_contribution": "this peer's offer went out, before it commits to the round",
    "before_slices": "the round's contributors are agreed, before this peer sends the slices of its gradient",
    "after_first_sum": "this peer sent the sum of its slice to one mate, before the others",
    "after_step": "the stage has stepped",
    "reply": "a forward or backward was computed, before its reply is encoded",
}
ACTIONS = ("die", "drop_reply", "delay", "freeze", "perturb", "nan")
TIMED = ("delay", "freeze")  # actions that take seconds
ONLY_AT = {"perturb": "after_step", "nan": "reply"}  # actions that make sense at one point only


class FaultError(ValueError):
    """A --faults entry that does not parse."""


@dataclass(frozen=True)
class Fault:
    """One entry of --faults: where it strikes, what it does, at which hit, and for how long (delay)."""

    point: str
    action: str
    hit: int | None = None  # strike only at this hit of the point; None: every hit
    seconds: float = 0.0  # delay, freeze


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
            seconds = float(argument) if action in TIMED else 0.0
        except ValueError:
            raise FaultError(f"{entry!r}: @N must be a whole number and {action}'s argument seconds") from None
        if number is not None and number < 1:
            raise FaultError(f"{entry!r}: hits count from 1")
        if action in ONLY_AT and point != ONLY_AT[action]:
            raise FaultError(f"{entry!r}: {action} applies at {ONLY_AT[action]} only")
        faults.append(Fault(point, action, number, seconds))
    return faults
