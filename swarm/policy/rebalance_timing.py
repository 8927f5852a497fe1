"""When a peer looks at the balance plan, and when a move the plan gives it is taken.

A pure state machine: it reads no clock and does no I/O. Its caller waits the seconds it names, does
what it names, and tells it what it found; random draws come from the `random.Random` it is given,
in a fixed order, so that a seeded caller sees the same waits every time. The real peer
(`swarm.peer.rebalancing`) and the simulator (`scripts/simulate.py`) both drive it, so the two
cannot time their moves differently.

The rule: a peer looks at the plan every `rebalance_period` seconds times a random factor in
[0.5, 1.5], randomised so that peers do not all look at the same moment and move in a herd. A
peer's first look comes within one period (a factor in [0, 1]), so a swarm started skewed is
balanced in one. If the plan moves it, a second look 1 to 2 announce periods later must move it
too: a DHT read that missed a stage, or a passing dip in someone's measured speed, must not send
a peer away. Only then does it move. Once moved, it does not move back to the stage it left within a
cool-down (`ReturnCooldown`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LOOK = "look"  # compute the balance plan: does it move this peer?
CONFIRM = "confirm"  # the second look: does the plan still move it?
MOVE = "move"  # both looks moved it: leave for the target now

FIRST_LOOK_PERIODS = (0.0, 1.0)  # a peer's first look, in rebalance periods
LATER_LOOK_PERIODS = (0.5, 1.5)  # every later look, in rebalance periods
CONFIRM_ANNOUNCE_PERIODS = (1.0, 2.0)  # the second look after the first, in announce periods


@dataclass(frozen=True)
class Wait:
    """What the peer does next (LOOK, CONFIRM or MOVE) and how many seconds it waits before."""

    action: str
    seconds: float


class RebalanceTiming:
    """One peer's rebalancing timing on one stage: a fresh one each time it starts serving a stage.

    `first_look`: the first look comes within one period (a peer that has not moved yet), not after
    0.5 to 1.5 periods. Each call returns the next `Wait`; calls must follow the action of the last
    one (`looked` after LOOK, `confirmed` after CONFIRM, `stayed` after MOVE), or RuntimeError.
    """

    def __init__(
        self, rebalance_period: float, announce_period: float, rng: random.Random, first_look: bool = True
    ) -> None:
        self.rebalance_period = rebalance_period
        self.announce_period = announce_period
        self.rng = rng
        self._first = first_look
        self.pending: str | None = None  # the action of the last Wait handed out

    def start(self) -> Wait:
        """The wait before the first look."""
        self._expect(None)
        return self._look()

    def looked(self, moves: bool, settled: bool = True) -> Wait:
        """After a look: whether the plan moves this peer (False too for a look skipped, as while not serving).

        `settled` False: the view did not yet rest on enough reads to plan on (`HeldRecords.ready`), so the
        peer looks again 1 to 2 announce periods later rather than a period later.
        """
        self._expect(LOOK)
        low, high = CONFIRM_ANNOUNCE_PERIODS
        if not settled:
            return self._next(LOOK, self.rng.uniform(low, high) * self.announce_period)
        if not moves:
            return self._look()
        return self._next(CONFIRM, self.rng.uniform(low, high) * self.announce_period)

    def confirmed(self, moves: bool) -> Wait:
        """After the second look: whether the plan still moves this peer (then MOVE, at once)."""
        self._expect(CONFIRM)
        return self._next(MOVE, 0.0) if moves else self._look()

    def stayed(self) -> Wait:
        """A move called off at the last moment (no other peer serves the stage): the peer looks again later."""
        self._expect(MOVE)
        return self._look()

    def _look(self) -> Wait:
        low, high = FIRST_LOOK_PERIODS if self._first else LATER_LOOK_PERIODS
        self._first = False
        return self._next(LOOK, self.rebalance_period * self.rng.uniform(low, high))

    def _next(self, action: str, seconds: float) -> Wait:
        self.pending = action
        return Wait(action, seconds)

    def _expect(self, action: str | None) -> None:
        if self.pending != action:
            last = self.pending or "nothing"
            raise RuntimeError(f"rebalance timing called out of order: the last wait was for {last}")


class ReturnCooldown:
    """The stages a peer may not move back to: each one it left, for `seconds` after it left.

    A move is judged to pay over the rebalance horizon; a move back within it undoes one that was
    judged so, which only noise or a view missing records could have made look right. The peer passes
    `barred` to the balance rule, which then moves another peer there, or none. Pure: `now` is given.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._left: dict[int, float] = {}  # stage -> when the peer last left it

    def left(self, stage: int, now: float) -> None:
        """The peer leaves `stage` now."""
        self._left[stage] = now

    def barred(self, now: float) -> frozenset[int]:
        """The stages the peer left less than `seconds` ago."""
        return frozenset(stage for stage, at in self._left.items() if now - at < self.seconds)
