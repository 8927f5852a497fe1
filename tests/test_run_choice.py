"""The runs rule, the simulation of several runs under churn, and its lower bound: pure, no network."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))

from simulation.runs_bound import lower_bound  # noqa: E402
from simulation.runs_flow import RunsScenario, SimRun, churn_trace, simulate_runs  # noqa: E402
from swarm.policy.run_choice import (  # noqa: E402
    GAIN,
    REFILL,
    RUN_MOVE_MARGIN,
    STARVING,
    Placement,
    RunState,
    choose_placement,
    fair_shares,
)


def run(run_id: str, caps: tuple[float, ...], remaining: float = 1000.0, **kw) -> RunState:
    """A run of unit-cost stages whose peers each give 1 sample/s per unit of capacity."""
    peers = kw.pop("peers", tuple(math.ceil(c) for c in caps))
    return RunState(run_id, kw.pop("priority", 1.0), remaining, (1.0,) * len(caps), caps, peers, **kw)


def test_a_newcomer_refills_an_empty_stage_before_anything_else():
    busy = run("busy", (1.0, 1.0), remaining=1e9)  # far more work left than the other
    gap = run("gap", (3.0, 0.0), remaining=10.0)
    choice = choose_placement([busy, gap], 1.0)
    assert choice.placement == Placement("gap", 1) and choice.kind == REFILL


def test_a_peer_serves_the_run_with_the_longest_weighted_remaining_time():
    short, long = run("short", (2.0, 2.0), remaining=100.0), run("long", (2.0, 2.0), remaining=400.0)
    assert choose_placement([short, long], 1.0).placement.run_id == "long"
    # a priority weighs the remaining time
    assert choose_placement([run("short", (2.0, 2.0), 100.0, priority=8.0), long], 1.0).placement.run_id == "short"
    # and a stage that does not hold its run back is no place to add pace
    uneven = run("uneven", (5.0, 1.0), remaining=400.0)
    assert choose_placement([uneven], 1.0).placement == Placement("uneven", 1)


def test_a_run_its_trainers_cannot_feed_faster_gets_no_more_peers():
    fed = run("fed", (2.0, 2.0), remaining=1e6, demand=2.0)
    other = run("other", (2.0, 2.0), remaining=10.0)
    assert choose_placement([fed, other], 1.0).placement.run_id == "other"


def test_a_starving_run_is_served_before_a_longer_one():
    long = run("long", (20.0, 20.0), remaining=1e9, peers=(20, 20))
    small = run("small", (1.0, 1.0), remaining=10.0)
    choice = choose_placement([long, small], 1.0)
    assert choice.placement.run_id == "small" and choice.kind == STARVING


def test_fair_shares_split_by_priority_within_what_trainers_use():
    a = run("a", (5.0, 5.0), priority=1.0)
    b = run("b", (5.0, 5.0), priority=3.0)
    assert fair_shares([a, b], total=40.0) == pytest.approx({"a": 10.0, "b": 30.0})
    capped = run("b", (5.0, 5.0), priority=3.0, demand=5.0)  # uses at most 5 samples/s x 2 flops
    assert fair_shares([a, capped], total=40.0) == pytest.approx({"a": 30.0, "b": 10.0})
    done = run("done", (5.0, 5.0), remaining=0.0)
    assert fair_shares([a, done], total=40.0) == pytest.approx({"a": 40.0, "done": 0.0})


def test_a_peer_never_leaves_a_stage_it_alone_serves_and_does_not_move_back():
    mine = run("mine", (1.0, 1.0), remaining=1.0)
    other = run("other", (1.0, 0.5), remaining=1e9, peers=(1, 1))
    choice = choose_placement([mine, other], 1.0, Placement("mine", 0))
    assert choice.placement == Placement("mine", 0)
    # with a mate on its stage, it moves to the run that needs it; from there the rule does not send it back
    mine = run("mine", (2.0, 1.0), remaining=1.0, peers=(2, 1))
    moved = choose_placement([mine, other], 1.0, Placement("mine", 0))
    assert moved.placement == Placement("other", 1) and moved.kind == GAIN
    after = [run("mine", (1.0, 1.0), remaining=1.0), run("other", (1.0, 1.5), remaining=1e9, peers=(1, 2))]
    assert choose_placement(after, 1.0, Placement("other", 1)).placement == Placement("other", 1)
    # a peer of a finished run goes where there is work
    finished = run("mine", (2.0, 1.0), remaining=0.0, peers=(2, 1))
    assert choose_placement([finished, other], 1.0, Placement("mine", 0)).placement.run_id == "other"


def test_a_peer_holding_its_stage_alone_waits_for_a_joiner_there_to_serve():
    """A joiner holds none of the stage's state until it has fetched it: the peer that holds it stays until the
    joiner serves, then moves where it is needed."""
    other = run("other", (1.0, 0.5), remaining=1e9, peers=(1, 1))
    joining = run("mine", (1.0, 1.0), remaining=1.0, peers=(2, 1), holders=(1, 1))
    stay = choose_placement([joining, other], 1.0, Placement("mine", 0))
    assert stay.placement == Placement("mine", 0) and stay.kind == REFILL
    served = run("mine", (2.0, 1.0), remaining=1.0, peers=(2, 1), holders=(2, 1))
    assert choose_placement([served, other], 1.0, Placement("mine", 0)).placement == Placement("other", 1)


def small_scenario(seed: int, churn: bool) -> RunsScenario:
    rng = random.Random(seed)
    speeds = tuple(rng.choice((1.0, 2.0, 4.0)) for _ in range(12))
    runs = (
        SimRun("big", (2.0, 2.0, 2.0), (1e6,) * 3, samples=4000.0, demand=3.0),
        SimRun("small", (1.0, 1.0), (1e6,) * 2, samples=3000.0, demand=6.0),
    )
    horizon = 20_000.0
    up = churn_trace(len(speeds), horizon, 1500.0 if churn else 0.0, 120.0, rng, always_up=4)
    return RunsScenario(speeds, runs, up, rebalance_period=20.0, announce_period=2.0, window=300.0, horizon=horizon)


@pytest.mark.parametrize("churn", [False, True])
def test_the_simulated_runs_finish_above_their_lower_bound_and_faster_than_one_after_another(churn):
    sc = small_scenario(3, churn)
    together = simulate_runs(sc, measure_split=True)
    assert all(t < sc.horizon for t in together.finished.values()), together.finished
    # what a better split would have trained is part of what was held back: the best split trains no faster
    # than the run's compute spread evenly
    assert 0.0 <= together.split_compute <= together.held_back_compute + 1e-9
    bound = lower_bound(sc.speeds, sc.up_times, sc.runs, sc.horizon)
    assert bound <= together.total <= 1.5 * bound
    alone, t = [], 0.0
    for r in sc.runs:
        t = simulate_runs(sc, [r], start=t).total
        alone.append(t)
    # each run alone is held to what its trainers feed: together they keep more of the peers busy
    assert together.total < 0.8 * alone[-1]
    assert together.shares and all(v > 0 for w in together.shares for v in w.values())
    if churn:
        assert together.joins > len(sc.speeds)  # peers came back, and were placed again


def test_a_free_split_leaves_nothing_to_a_better_split_and_trains_no_slower():
    """With every run's serving peers split at best whenever they change, no compute is held back that a better
    split would train, and the runs finish no later than under the balance rule's moves, which cost downloads."""
    sc = small_scenario(3, churn=True)
    ruled = simulate_runs(sc, measure_split=True)
    free = simulate_runs(dataclasses.replace(sc, free_split=True), measure_split=True)
    assert free.split_compute == pytest.approx(0.0, abs=1e-9) and ruled.split_compute > 0
    assert free.total <= ruled.total
    assert free.moves == free.run_moves  # no move within a run goes through the balance rule


def test_a_simulated_peer_never_moves_back_within_its_run_inside_the_rebalance_horizon():
    """As a real peer's plan bars every peer from a stage it left lately, the simulated balance rule moves none back
    there within the horizon (a peer process restarted for another run starts afresh)."""
    sc = small_scenario(3, churn=True)
    outcome = simulate_runs(sc)
    assert outcome.stage_moves
    left: dict[int, dict[int, float]] = {}  # peer -> stage of its run -> when it left
    at: dict[int, object] = {}  # peer -> where its last move took it
    for t, peer, source, target in outcome.stage_moves:
        if at.get(peer) != source:  # it served elsewhere since: a fresh peer process
            left[peer] = {}
        assert t - left[peer].get(target.stage, -math.inf) >= sc.balance_horizon
        left[peer][source.stage], at[peer] = t, target


def test_a_move_to_another_run_must_pay_for_its_state_download():
    """Within one class, a peer leaves its run only for a remaining time longer than its own run's by the margin
    and the least gain that pays for downloading the other run's stage state."""
    assert RUN_MOVE_MARGIN == pytest.approx(0.3)
    mine = run("mine", (2.0, 1.0), remaining=100.0, peers=(2, 1))  # without the peer: 1 sample/s, 100 s left
    other = run("other", (1.0, 1.0), remaining=140.0)  # 140 s left: 40% longer
    assert choose_placement([mine, other], 1.0, Placement("mine", 0)).placement == Placement("other", 0)
    costly = dataclasses.replace(other, move_gain=0.25)  # needs more than 30% + 25% longer
    assert choose_placement([mine, costly], 1.0, Placement("mine", 0)).placement == Placement("mine", 0)
    longer = dataclasses.replace(costly, remaining=160.0)
    assert choose_placement([mine, longer], 1.0, Placement("mine", 0)).placement == Placement("other", 0)
    # a peer that adds nothing where it is goes where it adds pace, even where no move could pay
    idle = run("mine", (3.0, 1.0), remaining=100.0, peers=(3, 1))  # its stage 0 holds nothing back
    unpayable = dataclasses.replace(other, move_gain=math.inf)
    assert choose_placement([idle, unpayable], 1.0, Placement("mine", 0)).placement == Placement("other", 0)
    # an empty stage is refilled whatever the move costs
    empty = run("other", (1.0, 0.0), remaining=10.0, peers=(1, 0), move_gain=math.inf)
    assert choose_placement([mine, empty], 1.0, Placement("mine", 0)).kind == REFILL


def test_the_lower_bound_is_exact_for_one_peer_and_one_run():
    runs = [SimRun("r", (2.0, 3.0), (0.0, 0.0), samples=100.0)]
    # one peer of 10 flops/s must give 100 x 5 flops: 50 s
    assert lower_bound([10.0], [((0.0, 1e6),)], runs, 1e6) == pytest.approx(50.0, rel=1e-3)
    # up only half the time past 20 s: the same work takes 80 s
    spells = [((0.0, 20.0), (30.0, 40.0), (50.0, 60.0), (70.0, 80.0), (90.0, 1e6))]
    assert lower_bound([10.0], spells, runs, 1e6) == pytest.approx(80.0, rel=1e-2)


def test_a_run_read_from_records_bounds_claims_and_progress():
    """One record claiming a vast throughput counts as a typical peer of its stage, and one announcing a far step
    cannot make its run look done; a joining peer counts as a peer of its stage without throughput."""
    from swarm.config import PeerConfig
    from swarm.config.run_files import RunFile
    from swarm.records.run_states import run_state, stage_flops
    from swarm.records.stage_records import JOINING, SERVING, StageRecord

    config = PeerConfig(run_id="red", num_stages=2, target_batch_size=10)
    red = RunFile("red.yaml", "red", total_steps=100, priority=1.0, config=config)

    def record(name: str, stage: int, throughput: float, step: int = 40, state: str = SERVING) -> StageRecord:
        return StageRecord(name, stage, "gpt-tiny", 2, state, step, throughput, 0, 10, 0, 1)

    records = {
        0: [record("a", 0, 4.0), record("b", 0, 5.0), record("liar", 0, 1e9, step=10**6)],
        1: [record("c", 1, 6.0), record("d", 1, 0.0, state=JOINING)],
    }
    state = run_state(red, records)
    assert state.capacities == (4.0 + 5.0 + 5.0, 6.0) and state.peers == (3, 2)  # the liar as the lower median
    assert state.holders == (3, 1)  # the joiner holds no state yet
    assert state.remaining == (100 - 40) * 10 and state.stage_flops == stage_flops(red)
    # a move into the run is priced by its stage state's download at the run's assumed bandwidth
    slow = dataclasses.replace(red, config=dataclasses.replace(config, move_bandwidth_mbit=0.01))
    assert 0 < state.move_gain < run_state(slow, records).move_gain
