"""The runs rule: which run, and which of its stages, a peer that may serve several runs joins. Pure.

A swarm may host several runs at once, each with its own model, stages, trainers and swarm file
(their records apart under their run ids). A peer started with `--run-id auto` serves one of them at
a time, and the one it serves is chosen here, from what every peer can read: each run's stage
capacities (its peers' announced throughputs), its remaining work and its priority.

Hydra schedules the model with the longest remaining time first, and so does the rule: a run's
weighted remaining time is its priority x its remaining samples / the samples per second it trains at,
its slowest stage's pace, and no faster than its trainers can feed it (`RunState.demand`). A peer
serves the run with the longest such time among those where it adds pace: at one of the stages that
hold the run back, while the run's trainers could send more. Runs then tend to finish together, which
is what keeps every peer busy to the end. Two bounds come first, in this order:

- a run with an empty stage trains nothing: it is refilled before anything else, the one with the
  most weighted work first;
- a run given less than `STARVING_SHARE` of its fair share of the swarm's compute (`fair_shares`: by
  priority among the runs with work left, none given more than its trainers can use) is served next,
  so that the longest run never starves the others.

A peer weighs its own run, as it would be without it, against the best other: it moves only for a
higher class (above), or within one class for a remaining time longer than its own run's by `margin`
(`RUN_MOVE_MARGIN`: a run's remaining time rests on measured speeds and on its peers' steps, so a lead of
a few per cent is noise) plus what the move costs (`RunState.move_gain`: the least gain that pays for
downloading a stage's state of the run it would join, as the balance rule prices a move within a run,
`swarm.policy.balance.MoveCost`); and it never leaves a stage whose state it alone holds while that run
has work left (a peer still joining there holds none). Moving back would need the reverse, which that
margin rules out. The move itself goes through the rebalancing timing (two looks with jittered waits),
which keeps peers that read one view from all moving at once.

Compute is compared in flops: a peer's speed is flops per second, and a sample at a stage costs that
stage's flops (`RunState.stage_flops`), so one peer's worth differs from run to run as their models do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

STARVING_SHARE = 0.5  # below this part of its fair share of the swarm's compute, a run is served first
RUN_MOVE_MARGIN = 0.3  # how much longer another run's weighted remaining time must be, besides the move's price
# seconds a peer takes to start serving another run, besides its state's download: its peer process for the
# old run stopped, one for the new run started and the stage built
RUN_MOVE_FIXED_SECONDS = 20.0
REFILL, STARVING, GAIN = 2, 1, 0  # the classes of a placement, most pressing first


@dataclass(frozen=True)
class RunState:
    """One run as the swarm's records show it."""

    run_id: str
    priority: float  # the organizer's weight for this run (1: as any other)
    remaining: float  # samples left to train; 0 once it is done
    stage_flops: tuple[float, ...]  # flops one sample costs at each stage, forward and backward
    capacities: tuple[float, ...]  # samples/s each stage serves now: its peers' throughputs summed
    peers: tuple[int, ...]  # serving and joining peers per stage
    demand: float = math.inf  # samples/s the run's trainers can send at most (inf: not known to bind)
    # serving peers per stage, which hold its state (a joiner holds none until it has fetched it); None: `peers`
    holders: tuple[int, ...] | None = None
    # the least gain that pays for a move into this run, a fraction (`MoveCost.least_gain` of its stage state)
    move_gain: float = 0.0

    def rate(self, capacities: Sequence[float] | None = None) -> float:
        """Samples/s the run trains at: its slowest stage, within what its trainers send."""
        return min(min(self.capacities if capacities is None else capacities), self.demand)

    def compute(self) -> float:
        """Flops per second its peers give it."""
        return sum(c * f for c, f in zip(self.capacities, self.stage_flops))

    @property
    def num_stages(self) -> int:
        return len(self.stage_flops)

    def holding(self, stage: int) -> int:
        """Peers that hold `stage`'s state."""
        return (self.peers if self.holders is None else self.holders)[stage]


@dataclass(frozen=True)
class Placement:
    """A run and one of its stages."""

    run_id: str
    stage: int


@dataclass(frozen=True)
class Choice:
    """Where a peer should be, why, and what staying would have been worth (for logs and the simulator)."""

    placement: Placement
    kind: int  # REFILL, STARVING or GAIN
    value: float  # the weighted remaining time (seconds) of the run it serves there, 0 where it adds nothing
    stay_value: float = 0.0  # the same for the peer's current placement; 0 for a newcomer

    @property
    def reason(self) -> str:
        return {REFILL: "its run has an empty stage", STARVING: "its run is short of its fair share"}.get(
            self.kind, "its run has the longest weighted remaining time"
        )


def without(runs: Sequence[RunState], placement: Placement, speed: float) -> list[RunState]:
    """The runs as they would be if a peer of `speed` flops/s left `placement`."""
    out = []
    for run in runs:
        if run.run_id == placement.run_id and 0 <= placement.stage < run.num_stages:
            s = placement.stage
            caps = list(run.capacities)
            caps[s] = max(0.0, caps[s] - speed / run.stage_flops[s])
            peers = list(run.peers)
            peers[s] = max(0, peers[s] - 1)
            # the leaver is taken for a holder: one still joining errs toward staying until it serves
            holders = [run.holding(stage) for stage in range(run.num_stages)]
            holders[s] = max(0, holders[s] - 1)
            run = replace(run, capacities=tuple(caps), peers=tuple(peers), holders=tuple(holders))
        out.append(run)
    return out


def fair_shares(runs: Sequence[RunState], total: float | None = None) -> dict[str, float]:
    """Each run's fair share of `total` flops/s (default: all the runs' peers' compute): split by priority
    among the runs with work left, none given more than its trainers can use (water-filling)."""
    total = sum(r.compute() for r in runs) if total is None else total
    shares = {r.run_id: 0.0 for r in runs}
    open_runs = [r for r in runs if r.remaining > 0 and r.priority > 0]
    usable = {r.run_id: r.demand * sum(r.stage_flops) for r in open_runs}  # flops/s its trainers can keep busy
    while open_runs and total > 0:
        weight = sum(r.priority for r in open_runs)
        capped = [r for r in open_runs if usable[r.run_id] <= total * r.priority / weight]
        if not capped:
            for r in open_runs:
                shares[r.run_id] = total * r.priority / weight
            break
        for r in capped:  # a run that cannot use its split takes what it can use; the rest is split again
            shares[r.run_id] = usable[r.run_id]
            total -= usable[r.run_id]
            open_runs.remove(r)
    return shares


def _starving(runs: Sequence[RunState]) -> set[str]:
    """Runs with work left given less than STARVING_SHARE of their fair share of the compute."""
    fair = fair_shares(runs)
    return {r.run_id for r in runs if r.remaining > 0 and r.compute() < STARVING_SHARE * fair[r.run_id]}


def _best_stage(run: RunState, speed: float) -> tuple[int, float]:
    """The stage of `run` where `speed` raises its pace most (empty stages first), and that pace."""
    best, best_key, best_rate = 0, None, 0.0
    for s in range(run.num_stages):
        caps = list(run.capacities)
        caps[s] += speed / run.stage_flops[s]
        rate = run.rate(caps)
        key = (run.peers[s] == 0, rate, -run.capacities[s] * run.stage_flops[s], -s)
        if best_key is None or key > best_key:
            best, best_key, best_rate = s, key, rate
    return best, best_rate


def _value(run: RunState, stage: int, speed: float, starving: set[str]) -> tuple[int, float]:
    """(class, value) of adding a peer of `speed` at `stage` of `run`: the value is the run's weighted remaining
    time, 0 where the peer would add no pace (the run is done, its trainers send no more, or the stage is not
    one of those holding it back)."""
    if run.remaining <= 0:
        return GAIN, 0.0
    rate = run.rate()
    if rate <= 0:
        # nothing trains until every stage has a peer: the run with the most weighted work goes first
        return (REFILL, run.priority * run.remaining) if run.peers[stage] == 0 else (GAIN, 0.0)
    if rate >= run.demand or run.capacities[stage] > min(run.capacities) * (1 + 1e-9):
        return GAIN, 0.0
    kind = STARVING if run.run_id in starving else GAIN
    return kind, run.priority * run.remaining / rate


def choose_placement(
    runs: Sequence[RunState], speed: float, current: Placement | None = None, margin: float = RUN_MOVE_MARGIN
) -> Choice | None:
    """Where a peer of `speed` flops/s should serve, given the runs as their records show them (with the peer
    counted where it serves now, `current`); None if there is no run. See the module's docstring."""
    if not runs:
        return None
    base = list(runs) if current is None else without(runs, current, speed)
    by_id = {r.run_id: r for r in base}
    if current is not None and current.run_id in by_id:
        left = by_id[current.run_id]
        # a stage whose state this peer alone holds stays served while its run has work: a joiner there holds
        # none yet, and would start the stage over were this peer to leave before it has fetched it
        if left.remaining > 0 and 0 <= current.stage < left.num_stages and left.holding(current.stage) == 0:
            return Choice(current, REFILL, math.inf, math.inf)
    starving = _starving(base)
    best: Choice | None = None
    for run in base:
        stage, _ = _best_stage(run, speed)
        kind, value = _value(run, stage, speed, starving)
        candidate = Choice(Placement(run.run_id, stage), kind, value)
        if best is None or (candidate.kind, candidate.value) > (best.kind, best.value):
            best = candidate
    assert best is not None
    if current is None or current.run_id not in by_id:
        return best
    stay_kind, stay_value = _value(by_id[current.run_id], current.stage, speed, starving)
    stay = Choice(current, stay_kind, stay_value, stay_value)
    if best.placement == current:
        return stay
    least = margin + by_id[best.placement.run_id].move_gain
    # a peer that adds nothing where it is goes where it adds pace, whatever the move costs (0 x inf is no bar)
    bar = stay_value * (1 + least) if stay_value > 0 else 0.0
    moves = best.kind > stay_kind or (best.kind == stay_kind and best.value > bar)
    return replace(best, stay_value=stay_value) if moves else stay
