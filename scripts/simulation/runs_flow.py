"""Several runs in one swarm, simulated: peers come and go, and each serves the run the runs rule picks.

The peers are the swarm's volunteers, each with a speed in flops/s and a churn trace of the times it is
up (`churn_trace`). Every run has its model's flops per sample at each stage, the samples it must train,
a priority, and the samples/s its trainers can feed it. Time advances in steps of `dt` seconds; at each:

- a peer whose trace ends an up-time leaves at once (preempted); one whose trace starts one joins where
  `swarm.policy.run_choice.choose_placement` puts it, serving after the time its stage's state takes to
  download (`MoveCost`-like: bytes over the link, plus a start-up);
- each serving peer moves as a real `--run-id auto` peer does, on two timings of
  `swarm.policy.rebalance_timing.RebalanceTiming` (a look every period, a second look to confirm): its
  supervisor's, to another run where the runs rule says so, and its peer process's, to another stage of
  its run where the balance rule's plan (`swarm.policy.balance.plan_moves`, at the peers' default margin
  and move cost, a move's start-up the peers' `MOVE_FIXED_SECONDS`) has it move, never back to a stage of
  the run it left within the rebalance horizon (`swarm.policy.rebalance_timing.ReturnCooldown`, which every
  peer's plan reads for every peer, as the real peers' own and held records do). It serves there after the
  download. With `free_split` instead, no balance rule runs: each run's serving peers are placed by their
  best split at once and free whenever they change, which bounds what a better balance within runs could
  give;
- each run trains at its slowest stage's pace (its peers' speeds over that stage's flops), within its
  trainers' feed, until its samples are done.

A peer on its way is counted where it goes in everyone's view, as a LEAVING record naming its target is.
The run of each peer, the compute each run was given per window, and the time each emptied stage took
to be refilled are recorded; `scripts/bench_runs.py` holds them against a lower bound
(`simulation.runs_bound`) and against the same runs trained one after another.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from simulation.scenario import PEER_DEFAULTS
from swarm.policy.balance import MOVE_FIXED_SECONDS, MoveCost, PeerLoad, ideal_assignment, plan_moves
from swarm.policy.rebalance_timing import CONFIRM, LOOK, MOVE, RebalanceTiming, ReturnCooldown
from swarm.policy.run_choice import (
    RUN_MOVE_FIXED_SECONDS,
    RUN_MOVE_MARGIN,
    Placement,
    RunState,
    choose_placement,
    fair_shares,
)

SPLIT_SEARCH_NODES = 20_000  # the best-split search's bound per set of peers (its results are cached)


@dataclass(frozen=True)
class SimRun:
    """One run: its model's cost per stage, its work, its weight, and what its trainers can feed."""

    name: str
    stage_flops: tuple[float, ...]  # per sample, forward and backward, per stage
    stage_bytes: tuple[float, ...]  # a stage's state (parameters, gradients, optimizer): what a joiner downloads
    samples: float  # to train in all
    demand: float = math.inf  # samples/s its trainers send at most
    priority: float = 1.0


@dataclass(frozen=True)
class RunsScenario:
    """The peers, the runs, and the swarm's timing."""

    speeds: tuple[float, ...]  # flops/s per peer
    runs: tuple[SimRun, ...]
    up_times: tuple[tuple[tuple[float, float], ...], ...]  # per peer: the (start, end) seconds it is up
    rebalance_period: float = 60.0
    announce_period: float = 10.0
    move_mbit: float = 1000.0  # what a joiner downloads its stage's state at
    move_overhead: float = RUN_MOVE_FIXED_SECONDS  # seconds a joiner (or a peer started for another run) takes to
    # start serving besides the download; a move within a run takes the peers' `MOVE_FIXED_SECONDS`
    margin: float = RUN_MOVE_MARGIN  # the runs rule's
    balance_margin: float = PEER_DEFAULTS.rebalance_margin  # the balance rule's, within a run
    balance_horizon: float = PEER_DEFAULTS.rebalance_horizon  # seconds a move within a run must pay off in
    dt: float = 1.0
    window: float = 1800.0  # seconds over which each run's share is measured
    horizon: float = 7 * 86400.0
    seed: int = 0
    # each run's serving peers placed on its stages by their best split, at once and free, whenever they change
    # (no balance rule, no move cost): what the runs rule reaches with a perfect balance within runs
    free_split: bool = False


@dataclass(eq=False)  # one peer's timing is itself, not any timing in the same state
class _Looks:
    """One rebalancing timing of a peer: the supervisor's (to other runs) or its peer process's (within its run)."""

    timing: RebalanceTiming
    next_at: float = math.inf
    action: str = ""
    target: Placement | None = None  # what the first look chose, for the second to confirm


@dataclass
class _Peer:
    index: int
    speed: float
    placement: Placement | None = None
    ready_at: float = math.inf  # when it serves its placement
    runs_looks: _Looks | None = None  # the supervisor's
    stage_looks: _Looks | None = None  # its peer process's
    cooldown: ReturnCooldown | None = None  # the stages of its run it left lately (a fresh one per peer process)

    def looks(self) -> list[_Looks]:
        return [looks for looks in (self.runs_looks, self.stage_looks) if looks is not None]


@dataclass
class RunsOutcome:
    """What one simulation gave."""

    finished: dict[str, float]  # run -> the time its last sample was trained (inf if it was not)
    shares: list[dict[str, float]]  # per window: given compute / fair share, for the runs busy all of it
    refills: list[float]  # seconds each emptied stage of a run with work left waited for a peer
    moves: int = 0
    run_moves: int = 0  # the moves to another run
    joins: int = 0
    idle_compute: float = 0.0  # share of the up peers' compute placed in no run with work left
    # share of the up peers' compute serving a run with work left beyond what its slowest stage (or its trainers'
    # feed) lets it train: a run's peers are whole, and churn upsets their split between its stages
    held_back_compute: float = 0.0
    # the part of it the best split of the same serving peers among the run's stages would have trained (the
    # rest is the peers' wholeness): what a better balance rule, or a faster one after churn, could win back
    split_compute: float = 0.0
    trace: list[dict[str, int]] = field(default_factory=list)  # per window: peers per run at its end
    # the moves within runs, as (time, peer, from, to)
    stage_moves: list[tuple[float, int, Placement, Placement]] = field(default_factory=list)

    @property
    def total(self) -> float:
        return max(self.finished.values())


def churn_trace(
    count: int, horizon: float, mean_up: float, mean_down: float, rng: random.Random, always_up: int = 0
) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Up-times of `count` peers: exponential up and down spells (spot instances reclaimed and restarted);
    the first `always_up` never go down. Every peer starts up."""
    traces = []
    for i in range(count):
        spells, t = [], 0.0
        while t < horizon:
            end = horizon if i < always_up or mean_up <= 0 else t + rng.expovariate(1 / mean_up)
            spells.append((t, min(end, horizon)))
            t = end + rng.expovariate(1 / mean_down)
        traces.append(tuple(spells))
    return tuple(traces)


def simulate_runs(
    scenario: RunsScenario, runs: Sequence[SimRun] | None = None, start: float = 0.0, measure_split: bool = False
) -> RunsOutcome:
    """Runs `runs` (default: all of the scenario's) from `start` until each is trained; see the docstring.
    `measure_split`: also find the best split of each run's peers whenever they change (`split_compute`)."""
    runs = list(scenario.runs if runs is None else runs)
    rng = random.Random(scenario.seed)
    peers = [_Peer(i, speed) for i, speed in enumerate(scenario.speeds)]
    remaining = {r.name: r.samples for r in runs}
    by_name = {r.name: r for r in runs}
    outcome = RunsOutcome({r.name: math.inf for r in runs}, [], [])
    empty_since: dict[tuple[str, int], float] = {}
    given = {r.name: 0.0 for r in runs}
    fair = {r.name: 0.0 for r in runs}
    busy_all_window = set(remaining)
    window_start, placed_compute, up_compute, held_back, split = start, 0.0, 0.0, 0.0, 0.0
    best_split = functools.lru_cache(maxsize=4096)(_best_split_rate)
    split_members: dict[str, frozenset[int]] = {}  # per run: its serving peers at its last free split
    t = start
    while t < scenario.horizon and any(v > 0 for v in remaining.values()):
        for peer in peers:
            up = _is_up(scenario.up_times[peer.index], t)
            if peer.placement is None and up:
                _join(scenario, peer, runs, remaining, peers, t, rng, outcome)
            elif peer.placement is not None and not up:
                peer.placement, peer.runs_looks, peer.stage_looks, peer.ready_at = None, None, None, math.inf
                peer.cooldown = None
        due = [(looks.next_at, peer.index, looks) for peer in peers for looks in peer.looks() if looks.next_at <= t]
        for _, index, looks in sorted(due, key=lambda d: d[:2]):
            peer = peers[index]
            if looks in peer.looks():  # not restarted by a move of its other timing this step
                _act(scenario, peer, looks, runs, remaining, peers, t, outcome)
        if scenario.free_split:
            _split_freely(runs, peers, t, split_members)
        states = _states(scenario, runs, remaining, peers, t, serving_only=True)
        for state in states:
            run = by_name[state.run_id]
            for s, count in enumerate(state.peers):
                key = (state.run_id, s)
                if count == 0 and remaining[state.run_id] > 0:
                    empty_since.setdefault(key, t)
                elif key in empty_since:
                    outcome.refills.append(t - empty_since.pop(key))
            if remaining[run.name] > 0:
                remaining[run.name] -= state.rate() * scenario.dt
                if remaining[run.name] <= 0:
                    outcome.finished[run.name] = t + scenario.dt
                    busy_all_window.discard(run.name)
        up_now = sum(p.speed for p in peers if _is_up(scenario.up_times[p.index], t))
        shares = fair_shares(states, up_now)
        for state in states:
            compute = state.compute()
            given[state.run_id] += compute * scenario.dt
            fair[state.run_id] += shares[state.run_id] * scenario.dt
            if remaining[state.run_id] > 0:
                rate, flops = state.rate(), sum(state.stage_flops)
                placed_compute += compute * scenario.dt
                held_back += (compute - rate * flops) * scenario.dt
                if measure_split:
                    best = best_split(_serving_speeds(peers, state.run_id, t), state.stage_flops)
                    split += (max(min(best, state.demand), rate) - rate) * flops * scenario.dt
        up_compute += up_now * scenario.dt
        t += scenario.dt
        if t - window_start >= scenario.window:
            outcome.shares.append({n: given[n] / fair[n] for n in busy_all_window if fair[n] > 0})
            outcome.trace.append(_peers_per_run(peers))
            given, fair = {n: 0.0 for n in given}, {n: 0.0 for n in fair}
            busy_all_window = {n for n, v in remaining.items() if v > 0}
            window_start = t
    outcome.idle_compute = 1 - placed_compute / up_compute if up_compute else 0.0
    outcome.held_back_compute = held_back / up_compute if up_compute else 0.0
    outcome.split_compute = split / up_compute if up_compute else 0.0
    return outcome


def _split_freely(runs: Sequence[SimRun], peers: Sequence[_Peer], t: float, members: dict[str, frozenset[int]]) -> None:
    """Places each run's serving peers by their best split whenever the set of them changed (`free_split`)."""
    for run in runs:
        mine = _serving(peers, run.name, t)
        now = frozenset(p.index for p in mine)
        if not mine or members.get(run.name) == now:
            continue
        members[run.name] = now
        flops = list(run.stage_flops)
        _, stages, _ = ideal_assignment([p.speed for p in mine], len(flops), flops, node_limit=SPLIT_SEARCH_NODES)
        for peer, stage in zip(mine, stages):
            peer.placement = Placement(run.name, stage)


def _serving(peers: Sequence[_Peer], run_id: str, t: float) -> list[_Peer]:
    """The peers serving `run_id` at `t` (placed there and done with their download)."""
    return [p for p in peers if p.placement is not None and p.placement.run_id == run_id and p.ready_at <= t]


def _serving_speeds(peers: Sequence[_Peer], run_id: str, t: float) -> tuple[float, ...]:
    """The speeds of the peers serving `run_id` at `t`, sorted: a run's peers as the best split sees them."""
    return tuple(sorted(p.speed for p in _serving(peers, run_id, t)))


def _best_split_rate(speeds: tuple[float, ...], stage_flops: tuple[float, ...]) -> float:
    """Samples/s the best split of peers of `speeds` among stages of `stage_flops` trains at (the best the
    search finds within its node limit: peers of a run are few, so it is exact in practice)."""
    if not speeds:
        return 0.0
    return ideal_assignment(list(speeds), len(stage_flops), list(stage_flops), node_limit=SPLIT_SEARCH_NODES)[0]


def _is_up(spells: Sequence[tuple[float, float]], t: float) -> bool:
    return any(a <= t < b for a, b in spells)


def _peers_per_run(peers: Sequence[_Peer]) -> dict[str, int]:
    count: dict[str, int] = {}
    for peer in peers:
        if peer.placement is not None:
            count[peer.placement.run_id] = count.get(peer.placement.run_id, 0) + 1
    return count


def _states(
    scenario: RunsScenario,
    runs: Sequence[SimRun],
    remaining: dict[str, float],
    peers: Sequence[_Peer],
    t: float,
    serving_only: bool,
) -> list[RunState]:
    """The runs as records show them: every placed peer where it is (or goes), or only those serving."""
    states = []
    for run in runs:
        caps, count, holders = [0.0] * len(run.stage_flops), [0] * len(run.stage_flops), [0] * len(run.stage_flops)
        for peer in peers:
            placement = peer.placement
            if placement is None or placement.run_id != run.name or (serving_only and peer.ready_at > t):
                continue
            caps[placement.stage] += peer.speed / run.stage_flops[placement.stage]
            count[placement.stage] += 1
            holders[placement.stage] += peer.ready_at <= t
        left = max(0.0, remaining[run.name])
        gain = _move_cost(scenario, run).least_gain()
        states.append(
            RunState(
                run.name,
                run.priority,
                left,
                run.stage_flops,
                tuple(caps),
                tuple(count),
                run.demand,
                tuple(holders),
                move_gain=gain,
            )
        )
    return states


def _move_cost(scenario: RunsScenario, run: SimRun, fixed: float | None = None) -> MoveCost:
    """A move into `run` (`fixed` seconds besides the download: within it, a move's), priced as the peers price one:
    its largest stage's state downloaded."""
    fixed = scenario.move_overhead if fixed is None else fixed
    return MoveCost.of_state(max(run.stage_bytes) / 2**20, scenario.move_mbit, fixed, scenario.balance_horizon)


def _arrive(
    scenario: RunsScenario, peer: _Peer, runs: Sequence[SimRun], placement: Placement, t: float, within: bool = False
) -> None:
    """`peer` starts for `placement`: it serves after the download and the start-up (`within` its run: a move's)."""
    run = next(r for r in runs if r.name == placement.run_id)
    download = run.stage_bytes[placement.stage] * 8 / (scenario.move_mbit * 1e6)
    fixed = MOVE_FIXED_SECONDS if within else scenario.move_overhead
    peer.placement, peer.ready_at = placement, t + fixed + download


def _join(scenario, peer, runs, remaining, peers, t, rng, outcome) -> None:
    choice = choose_placement(_states(scenario, runs, remaining, peers, t, serving_only=False), peer.speed)
    if choice is None:
        return
    _arrive(scenario, peer, runs, choice.placement, t)
    outcome.joins += 1
    _start_looks(scenario, peer, rng, first_look=True)


def _start_looks(scenario: RunsScenario, peer: _Peer, rng: random.Random, first_look: bool) -> None:
    """A peer process (re)started: both timings begin again from when it serves."""
    peer.runs_looks = _fresh_looks(scenario, rng, first_look, peer.ready_at)
    peer.stage_looks = _fresh_looks(scenario, rng, first_look, peer.ready_at)
    peer.cooldown = ReturnCooldown(scenario.balance_horizon)


def _fresh_looks(scenario: RunsScenario, rng: random.Random, first_look: bool, at: float) -> _Looks:
    """A timing that begins at `at`, its first wait drawn."""
    looks = _Looks(RebalanceTiming(scenario.rebalance_period, scenario.announce_period, rng, first_look))
    wait = looks.timing.start()
    looks.action, looks.next_at = wait.action, at + wait.seconds
    return looks


def _act(scenario, peer, looks, runs, remaining, peers, t, outcome) -> None:
    """The look, confirmation or move of one of the peer's timings that is due."""
    assert peer.placement is not None
    if looks.action == MOVE:
        target = looks.target
        assert target is not None
        to_run = target.run_id != peer.placement.run_id
        outcome.run_moves += to_run
        if not to_run:
            assert peer.cooldown is not None
            peer.cooldown.left(peer.placement.stage, t)
            outcome.stage_moves.append((t, peer.index, peer.placement, target))
        _arrive(scenario, peer, runs, target, t, within=not to_run)
        outcome.moves += 1
        rng = looks.timing.rng
        if to_run:  # the supervisor starts a peer process for the other run
            _start_looks(scenario, peer, rng, first_look=False)
        else:  # the peer process moved itself: its own timing begins again
            peer.stage_looks = _fresh_looks(scenario, rng, False, peer.ready_at)
        return
    if looks is peer.runs_looks:
        view = _states(scenario, runs, remaining, peers, t, serving_only=False)
        choice = choose_placement(view, peer.speed, peer.placement, scenario.margin)
        target = choice.placement if choice is not None and choice.placement.run_id != peer.placement.run_id else None
    else:
        target = None if scenario.free_split else _balance_move(scenario, peer, runs, peers, t)
    if looks.action == LOOK:
        looks.target = target
        wait = looks.timing.looked(target is not None)
    else:
        assert looks.action == CONFIRM
        wait = looks.timing.confirmed(target is not None and target == looks.target)
    looks.action, looks.next_at = wait.action, t + wait.seconds


def _balance_move(
    scenario: RunsScenario, peer: _Peer, runs: Sequence[SimRun], peers: Sequence[_Peer], t: float
) -> Placement | None:
    """Where the balance rule moves `peer` within its run, as the run's peers would plan it; None to stay."""
    assert peer.placement is not None
    run_id = peer.placement.run_id
    run = next(r for r in runs if r.name == run_id)
    mates = [p for p in peers if p.placement is not None and p.placement.run_id == run_id]
    loads = [
        PeerLoad(str(p.index), p.placement.stage, p.speed / run.stage_flops[p.placement.stage], p.ready_at <= t)
        for p in mates
    ]
    barred = {str(p.index): p.cooldown.barred(t) for p in mates if p.cooldown is not None}
    plan = plan_moves(
        loads,
        len(run.stage_flops),
        scenario.balance_margin,
        run.stage_flops,
        move_cost=_move_cost(scenario, run, MOVE_FIXED_SECONDS),
        barred=barred,
    )
    mine = next((m for m in plan if m.peer_id == str(peer.index)), None)
    if mine is None or mine.source != peer.placement.stage:
        return None
    return Placement(run_id, mine.target)
