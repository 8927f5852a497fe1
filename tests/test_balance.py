"""The balance rule: moves toward the bottleneck, never empties a stage, never oscillates; the exact ideal."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from swarm.models import get_model_spec
from swarm.policy.balance import (
    MoveCost,
    PeerLoad,
    assignment_throughput,
    capacities,
    choose_stage,
    ideal_assignment,
    loads_from_records,
    plan_moves,
    stage_costs,
    upper_bound_throughput,
)
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord


def peers_on(stages: dict[int, list[float]], joining: dict[int, list[float]] | None = None) -> list[PeerLoad]:
    peers = [PeerLoad(f"s{s}p{i}", s, v) for s, speeds in stages.items() for i, v in enumerate(speeds)]
    for s, speeds in (joining or {}).items():
        peers += [PeerLoad(f"s{s}j{i}", s, v, serving=False) for i, v in enumerate(speeds)]
    return peers


def apply(peers: list[PeerLoad], plan) -> list[PeerLoad]:
    target = {m.peer_id: m.target for m in plan}
    return [PeerLoad(p.peer_id, target.get(p.peer_id, p.stage), p.throughput, p.serving) for p in peers]


def test_moves_peers_toward_the_bottleneck():
    peers = peers_on({0: [10, 10, 10, 10], 1: [10], 2: [10, 10]})
    plan = plan_moves(peers, 3, margin=0.1)
    assert plan and all(m.target == 1 for m in plan[:1])
    assert all(m.source != m.target for m in plan)
    after = capacities(apply(peers, plan), 3)
    assert min(after) > min(capacities(peers, 3))
    assert sorted(after) == [20.0, 20.0, 30.0]


def test_an_empty_stage_is_filled_first_and_none_is_emptied():
    # everyone started on stage 0: stages 1..3 have no capacity at all
    peers = peers_on({0: [5.0] * 8})
    plan = plan_moves(peers, 4, margin=0.1)
    after = apply(peers, plan)
    assert sorted(capacities(after, 4)) == [10.0, 10.0, 10.0, 10.0]
    # a stage with a single serving peer never gives it away, however much others need it
    lone = peers_on({0: [100.0], 1: [1.0]})
    assert plan_moves(lone, 2, margin=0.0) == []


def test_joining_peers_count_as_capacity_but_never_keep_a_stage_alive():
    # stage 1 has a joiner on its way: no one else needs to go there
    peers = peers_on({0: [10, 10], 1: [10]}, joining={1: [10]})
    assert plan_moves(peers, 2, margin=0.1) == []
    # stage 0's only serving peer cannot leave even though a joiner is arriving there
    peers = peers_on({0: [10], 1: []}, joining={0: [10]})
    assert plan_moves(peers, 2, margin=0.1) == []


@pytest.mark.parametrize("margin", [0.0, 0.05, 0.2])
def test_equal_loads_do_not_oscillate(margin):
    peers = peers_on({0: [4, 4], 1: [4, 4]})
    assert plan_moves(peers, 2, margin=margin) == []
    # whatever the start, applying plans reaches a fixed point: the next plan is empty
    rng = random.Random(3)
    for _ in range(50):
        speeds = [rng.randint(1, 10) for _ in range(rng.randint(3, 12))]
        peers = [PeerLoad(f"p{i}", rng.randrange(3), v) for i, v in enumerate(speeds)]
        for _round in range(len(peers) + 1):
            plan = plan_moves(peers, 3, margin=margin)
            if not plan:
                break
            peers = apply(peers, plan)
        assert plan_moves(peers, 3, margin=margin) == []


def test_hysteresis_margin_holds_back_small_gains():
    # moving one 10 peer lifts the lower of the two stages from 12 to 20: 0.8 of the mover's speed
    peers = peers_on({0: [10, 10, 10], 1: [12]})
    assert len(plan_moves(peers, 2, margin=0.5)) == 1
    assert plan_moves(peers, 2, margin=0.9) == []


@pytest.mark.parametrize("seed", range(200))
def test_a_plan_always_leaves_each_stage_a_serving_peer_that_stays(seed):
    rng = random.Random(seed)
    num_stages = rng.randint(2, 5)
    peers = [
        PeerLoad(f"p{i}", rng.randrange(num_stages), rng.uniform(1, 10) * rng.choice([1, 1, 0.2]), rng.random() > 0.2)
        for i in range(rng.randint(2, 12))
    ]
    plan = plan_moves(peers, num_stages, margin=rng.choice([0.0, 0.1]))
    leaving = {m.peer_id for m in plan}
    for stage in range(num_stages):
        if any(p.serving and p.stage == stage for p in peers):
            assert any(p.serving and p.stage == stage and p.peer_id not in leaving for p in peers), (stage, plan)


def test_plans_agree_between_peers_and_respect_max_moves():
    peers = peers_on({0: [3, 5, 7, 9, 11, 13], 1: [2], 2: [2]})
    shuffled = list(reversed(peers))
    assert plan_moves(peers, 3) == plan_moves(shuffled, 3)
    assert len(plan_moves(peers, 3, max_moves=1)) == 1


def test_stage_costs_scale_a_peers_speed_on_another_stage():
    # stage 1 costs 3 times stage 0: a peer of 9 samples/s on stage 0 gives 3 samples/s there
    peers = peers_on({0: [9, 9, 9], 1: [1]})
    plan = plan_moves(peers, 2, margin=0.1, costs=[0.5, 1.5])
    assert plan and plan[0].low_after == pytest.approx(4.0)
    spec = get_model_spec("gpt-tiny")
    costs = stage_costs(spec, 3)
    assert sum(costs) == pytest.approx(3.0)
    assert costs[2] > costs[1]  # the last stage also runs the head


def test_newcomers_join_the_bottleneck_and_spread_over_empty_stages():
    peers = peers_on({0: [10, 10], 1: [3], 2: [10]})
    assert choose_stage(peers, 3, rng=random.Random(0)) == 1
    chosen = {choose_stage([], 4, rng=random.Random(seed)) for seed in range(40)}
    assert chosen == {0, 1, 2, 3}


def test_loads_from_records_skip_leaving_peers():
    def record(peer, stage, state):
        return StageRecord(peer, stage, "gpt-tiny", 2, state, 0, 5.0, 1, 32, 0, 2, 99.0)

    records = {0: [record("a", 0, SERVING), record("b", 0, LEAVING)], 1: [record("c", 1, JOINING)]}
    loads = loads_from_records(records)
    assert [(p.peer_id, p.serving) for p in loads] == [("a", True), ("c", False)]


def test_pinned_peers_hold_their_stage_but_are_never_planned_to_move():
    # a peer that never rebalances would block the move forever if the plan counted on it
    free = [PeerLoad("pinned", 0, 10.0, movable=False), PeerLoad("free", 0, 14.0), PeerLoad("b", 1, 5.0)]
    assert [(m.peer_id, m.target) for m in plan_moves(free, 2, margin=0.1)] == [("free", 1)]
    # the slower pinned peer would have been the better mover; with it free, the plan picks it
    assert [m.peer_id for m in plan_moves([PeerLoad("pinned", 0, 10.0), *free[1:]], 2, margin=0.1)] == ["pinned"]
    # a pinned peer still keeps its stage alive, and a stage of pinned peers gives none away
    assert plan_moves([PeerLoad("a", 0, 10.0, movable=False), PeerLoad("b", 1, 1.0)], 2, margin=0.1) == []
    # only a trade helps here (5 to stage 1, the 1 back); a pinned slow peer cannot be traded
    trade = [PeerLoad("a", 0, 5.0), PeerLoad("b", 0, 10.0), PeerLoad("slow", 1, 1.0), PeerLoad("c", 1, 9.0)]
    assert {(m.peer_id, m.target) for m in plan_moves(trade, 2, margin=0.1)} == {("a", 1), ("slow", 0)}
    trade[2] = PeerLoad("slow", 1, 1.0, movable=False)
    assert plan_moves(trade, 2, margin=0.1) == []


PEER_A = "12D3KooWCCxwv4TYQSH9TvqY5yqfLN57aG2hSPVbHBz7ZrHtywdp"


def test_records_carry_whether_a_peer_may_move_and_older_records_still_parse():
    pinned = StageRecord(PEER_A, 0, "gpt-tiny", 2, SERVING, 0, 5.0, 1, 32, 0, 2, 99.0, movable=False)
    parsed = StageRecord.from_value(pinned.to_value(), 99.0)
    assert parsed == pinned
    assert loads_from_records({0: [parsed]})[0].movable is False
    older = pinned.to_value()
    del older["movable"]
    assert StageRecord.from_value(older, 99.0).movable is True
    assert StageRecord.from_value({**pinned.to_value(), "movable": "yes"}, 99.0) is None


def brute_force(speeds, num_stages, costs=None):
    return max(
        assignment_throughput(speeds, stages, num_stages, costs)
        for stages in itertools.product(range(num_stages), repeat=len(speeds))
    )


@pytest.mark.parametrize("seed", range(12))
def test_ideal_assignment_is_exact(seed):
    rng = random.Random(seed)
    num_stages = rng.choice([2, 3])
    speeds = [rng.randint(1, 10) for _ in range(rng.randint(num_stages, 8))]
    costs = None if seed % 2 else [rng.choice([1.0, 2.0]) for _ in range(num_stages)]
    value, stages, proven = ideal_assignment(speeds, num_stages, costs)
    assert proven
    assert value == pytest.approx(brute_force(speeds, num_stages, costs))
    assert assignment_throughput(speeds, stages, num_stages, costs) == pytest.approx(value)
    assert value <= upper_bound_throughput(speeds, num_stages, costs) + 1e-9


def test_balance_rule_reaches_most_of_the_ideal_from_one_stage():
    rng = random.Random(0)
    speeds = [rng.randint(2, 20) for _ in range(24)]
    ideal, _, proven = ideal_assignment(speeds, 4)
    assert proven
    peers = [PeerLoad(f"p{i:02d}", 0, float(v)) for i, v in enumerate(speeds)]
    for _ in range(5):
        peers = apply(peers, plan_moves(peers, 4, margin=0.05))
    assert min(capacities(peers, 4)) >= 0.9 * ideal


def exhaustive_plan(peers: list[PeerLoad], num_stages: int, margin: float) -> list[tuple[str, int, int]]:
    """The rule written out plainly: at each step every peer (and pair) is tried. Slow, but obviously the rule."""
    caps, holders = capacities(peers, num_stages), [0] * num_stages
    queues = [0] * num_stages
    for p in peers:
        holders[p.stage] += p.serving
        queues[p.stage] += p.queue_length
    free = {p.peer_id: p for p in peers if p.serving and p.movable}
    plan = []
    while True:
        target = min(range(num_stages), key=lambda s: (caps[s], -queues[s], s))
        need = 0.0 if caps[target] <= 0 else margin
        best = None
        for p in free.values():
            if p.stage != target and holders[p.stage] >= 2:
                low = min(caps[target] + p.throughput, caps[p.stage] - p.throughput)
                if low - caps[target] > need * p.throughput and (best is None or (low, p.peer_id) > best[:2]):
                    best = (low, p.peer_id, [p])
        if best is None and holders[target] >= 2:
            for a in free.values():
                for b in free.values():
                    if a.stage == target or b.stage != target or holders[a.stage] < 2 or a.throughput <= b.throughput:
                        continue
                    low = min(caps[target] - b.throughput + a.throughput, caps[a.stage] - a.throughput + b.throughput)
                    key = (low, a.peer_id, b.peer_id)
                    if low - caps[target] > need * a.throughput and (best is None or key > best[:3]):
                        best = (*key, [a, b])
        if best is None:
            return plan
        movers = best[-1]
        destinations = [target] if len(movers) == 1 else [target, movers[0].stage]
        for p, to in zip(movers, destinations):
            caps[p.stage] -= p.throughput
            caps[to] += p.throughput
            holders[p.stage] -= 1
            del free[p.peer_id]
            plan.append((p.peer_id, p.stage, to))
        queues = [0] * num_stages


@pytest.mark.parametrize("seed", range(300))
def test_the_fast_plan_is_the_rule(seed):
    rng = random.Random(seed)
    num_stages = rng.randint(2, 5)
    integer = seed % 2 == 0
    peers = [
        PeerLoad(
            f"p{i}",
            rng.randrange(num_stages) if rng.random() < 0.6 else 0,
            float(rng.randint(1, 10)) if integer else rng.uniform(1, 10) * rng.choice([1, 1, 0.2]),
            rng.random() > 0.15,
            rng.randint(0, 3),
            rng.random() > 0.1,
        )
        for i in range(rng.randint(2, 30))
    ]
    margin = rng.choice([0.0, 0.1, 0.5, 0.9])
    fast = [(m.peer_id, m.source, m.target) for m in plan_moves(peers, num_stages, margin)]
    assert fast == exhaustive_plan(peers, num_stages, margin)


def skewed(count: int, num_stages: int, seed: int) -> list[PeerLoad]:
    rng = random.Random(seed)
    return [
        PeerLoad(f"peer{i:05d}", 0 if rng.random() < 0.7 else rng.randrange(1, num_stages), rng.uniform(2, 20))
        for i in range(count)
    ]


def test_every_peer_computes_the_same_plan_and_it_nears_the_ideal():
    peers = skewed(2000, 8, seed=1)
    records = {s: [] for s in range(8)}
    for p in peers:
        records[p.stage].append(StageRecord(p.peer_id, p.stage, "gpt-tiny", 8, SERVING, 0, p.throughput, 0, 32, 0, 2))
    plans = []
    for order in range(4):  # each peer reads the records in its own order
        shuffled = {s: random.Random(order).sample(found, len(found)) for s, found in records.items()}
        plans.append(plan_moves(loads_from_records(dict(reversed(list(shuffled.items())))), 8, margin=0.5))
    assert all(plan == plans[0] for plan in plans)
    after = apply(peers, plans[0])
    assert min(capacities(after, 8)) >= 0.99 * upper_bound_throughput([p.throughput for p in peers], 8)


def test_a_plan_stays_the_plan_while_its_movers_are_on_their_way():
    # the first movers announce LEAVING naming their targets: everyone's plan is then the rest of it
    rng = random.Random(5)
    peers = [PeerLoad(f"p{i:03d}", 0 if i < 40 else 1 + i % 3, float(rng.randint(2, 20))) for i in range(60)]
    plan = plan_moves(peers, 4, margin=0.5)
    assert len(plan) > 8

    def record(p: PeerLoad, state: str, moving_to: int = -1) -> StageRecord:
        return StageRecord(p.peer_id, p.stage, "gpt-tiny", 4, state, 0, p.throughput, 0, 32, 0, 2, moving_to=moving_to)

    on_their_way = {m.peer_id: m.target for m in plan[:5]}
    records = {s: [] for s in range(4)}
    for p in peers:
        state = LEAVING if p.peer_id in on_their_way else SERVING
        records[p.stage].append(record(p, state, on_their_way.get(p.peer_id, -1)))
    loads = loads_from_records(records)
    assert {(p.peer_id, p.stage, p.serving) for p in loads if p.peer_id in on_their_way} == {
        (peer_id, target, False) for peer_id, target in on_their_way.items()
    }
    rest = plan_moves(loads, 4, margin=0.5)
    assert [(m.peer_id, m.target) for m in rest] == [(m.peer_id, m.target) for m in plan[5:]]
    # once it serves on its target, the LEAVING record it left behind no longer counts
    mover, target = plan[0].peer_id, plan[0].target
    records[target].append(record(PeerLoad(mover, target, 9.0), SERVING))
    assert [(p.stage, p.serving) for p in loads_from_records(records) if p.peer_id == mover] == [(target, True)]


def test_an_empty_stage_is_filled_whatever_the_margin_or_the_cost():
    costly = MoveCost(transfer_seconds=150.0, averaging_seconds=50.0, horizon_seconds=120.0)
    assert costly.least_gain() == math.inf  # the gain could never be earned back within the horizon
    peers = peers_on({0: [5.0, 5.0, 5.0], 1: [5.0, 5.0], 2: []})
    plan = plan_moves(peers, 3, margin=0.9, move_cost=costly)
    assert [m.target for m in plan] == [2]  # filled, and nothing more: no other move pays


def test_a_move_must_pay_for_its_state_transfer_and_averaging():
    peers = peers_on({0: [10, 10, 10], 1: [12]})  # moving a 10 lifts the lower stage by 8: 0.8 of the mover
    cheap = MoveCost.of_state(state_mb=100, bandwidth_mbit=800, fixed_seconds=5, horizon_seconds=600)
    assert cheap.least_gain() == pytest.approx((5 + 1 + 1) / (600 - 6))
    assert len(plan_moves(peers, 2, margin=0.0, move_cost=cheap)) == 1
    # 10 GB over 100 Mbit/s: 800 s of download, and as much uploaded by the target's mates; never within 600 s
    dear = MoveCost.of_state(state_mb=10_000, bandwidth_mbit=100, fixed_seconds=5, horizon_seconds=600)
    assert plan_moves(peers, 2, margin=0.0, move_cost=dear) == []
    # a gain of 0.8 of the mover pays for costs up to 0.8 of the horizon's earning time
    middling = MoveCost(transfer_seconds=40, averaging_seconds=40, horizon_seconds=140)  # 80 / 100
    assert plan_moves(peers, 2, margin=0.0, move_cost=middling) == []
    assert len(plan_moves(peers, 2, margin=0.0, move_cost=MoveCost(40, 30, 140))) == 1  # 70 / 100


def with_spread(peers: list[PeerLoad], relative: float) -> list[PeerLoad]:
    return [replace(p, spread=relative * p.throughput) for p in peers]


def test_a_move_within_the_noise_of_the_speeds_it_rests_on_is_not_made():
    # the lower of the two would go from 39.1 to 40.7 (+4%): a slow peer of stage 0 for stage 1
    peers = peers_on({0: [3, 12, 13, 15.7], 1: [9.1, 10, 10, 10], 2: [15, 15, 15], 3: [15, 15, 15]})
    exact = plan_moves(peers, 4, margin=0.5)
    assert [(m.source, m.target, round(m.low_before, 1), round(m.low_after, 1)) for m in exact] == [(0, 1, 39.1, 40.7)]
    # speeds measured within 10%: the two stages differ by less than their noise, so nothing moves
    assert plan_moves(with_spread(peers, 0.1), 4, margin=0.5) == []
    assert plan_moves(with_spread(peers, 0.1), 4, margin=0.5, deviations=0.0) == exact  # the rule before


def test_clear_gaps_still_move_under_noise_and_stop_within_it():
    rng = random.Random(5)
    peers = [PeerLoad(f"p{i}", 0, float(rng.randint(2, 20))) for i in range(200)]
    noisy = with_spread(peers, 0.2)
    after = apply(noisy, plan_moves(noisy, 4, margin=0.1))
    ideal = upper_bound_throughput([p.throughput for p in peers], 4)
    assert min(capacities(after, 4)) >= 0.9 * ideal
    # and the plan on the result moves nobody: what is left is within the noise
    assert plan_moves(with_spread(after, 0.2), 4, margin=0.1) == []


def test_a_peer_barred_from_a_stage_is_not_moved_there_and_another_is():
    peers = peers_on({0: [10, 10, 10, 10], 1: [10]})
    plan = plan_moves(peers, 2, margin=0.1)
    first = plan[0].peer_id
    barred = plan_moves(peers, 2, margin=0.1, barred={first: {1}})
    assert barred and first not in {m.peer_id for m in barred}
    # every peer of the donor barred: nobody moves
    assert plan_moves(peers, 2, margin=0.1, barred={p.peer_id: [1] for p in peers}) == []


def test_loads_carry_the_measured_spread_of_each_peer():
    def record(peer, stage, state, throughput):
        return StageRecord(peer, stage, "gpt-tiny", 2, state, 0, throughput, 1, 32, 0, 2, 99.0)

    records = {0: [record("a", 0, SERVING, 10.0), record("b", 0, SERVING, 20.0)]}
    loads = {p.peer_id: p for p in loads_from_records(records, spreads={"a": 0.1})}
    assert loads["a"].spread == pytest.approx(1.0) and loads["b"].spread == 0.0
