"""The view the balance rule reads: lapsed records held for a grace period, and each peer's measured spread."""

from __future__ import annotations

import pytest

from swarm.policy.balance import capacities, loads_from_records, plan_moves
from swarm.policy.held_records import HeldRecords
from swarm.records.stage_records import LEAVING, SERVING, StageRecord


def record(peer: str, stage: int, throughput: float, expiration: float, state: str = SERVING, moving_to: int = -1):
    return StageRecord(peer, stage, "gpt-tiny", 2, state, 0, throughput, 0, 32, 0, 2, expiration, moving_to=moving_to)


def read(now: float, **stages: list[tuple[str, float]]) -> dict[int, list[StageRecord]]:
    return {int(s[1:]): [record(p, int(s[1:]), v, now + 10) for p, v in found] for s, found in stages.items()}


def test_a_stage_whose_records_lapsed_is_not_empty_until_the_grace_period_has_passed():
    held = HeldRecords(grace=30.0)
    both = read(0.0, s0=[("a", 10), ("b", 10), ("c", 10)], s1=[("d", 10), ("e", 10)])
    held.update(both, 0.0)
    lapsed = read(5.0, s0=[("a", 10), ("b", 10), ("c", 10)], s1=[])  # stage 1's key read came back empty
    assert capacities(loads_from_records(lapsed), 2) == [30.0, 0.0]
    view = held.update(lapsed, 5.0)
    assert capacities(loads_from_records(view), 2) == [30.0, 20.0]
    # read as it was, stage 1 looks empty and the rule fills it first; held, nothing moves
    assert plan_moves(loads_from_records(lapsed), 2, margin=0.5)
    assert plan_moves(loads_from_records(view), 2, margin=0.5) == []
    # gone for longer than the grace: it is gone
    view = held.update(read(31.0, s0=[("a", 10), ("b", 10), ("c", 10)], s1=[]), 31.0)
    assert capacities(loads_from_records(view), 2) == [30.0, 0.0]


def test_a_peer_seen_elsewhere_is_not_held_where_it_was():
    held = HeldRecords(grace=30.0)
    held.update(read(0.0, s0=[("a", 10), ("b", 10)], s1=[("c", 10)]), 0.0)
    leaving = {0: [record("a", 0, 10, 12, LEAVING, moving_to=1), record("b", 0, 10, 12)], 1: [record("c", 1, 10, 12)]}
    view = held.update(leaving, 2.0)
    assert [r.state for r in view[0] if r.peer_id == "a"] == [LEAVING]
    view = held.update(read(4.0, s0=[("b", 10)], s1=[("c", 10), ("a", 10)]), 4.0)
    assert sorted(r.peer_id for r in view[0]) == ["b"] and sorted(r.peer_id for r in view[1]) == ["a", "c"]


def test_spreads_are_measured_from_renewals_and_pooled_for_peers_read_few_times():
    held = HeldRecords(grace=30.0)
    assert held.spreads() is None and not held.ready()
    noisy = [10.0, 12.0, 8.0, 11.0, 9.0]
    for t, v in enumerate(noisy):
        held.update(read(float(t), s0=[("a", v), ("b", 20.0)], s1=[("c", 5.0)] if t == 4 else []), float(t))
    spreads = held.spreads()
    a = (sum((x - 10.0) ** 2 for x in noisy) / 4) ** 0.5 / 10.0
    assert spreads["a"] == pytest.approx(a)
    pooled = ((a**2 + 0.0) / 2) ** 0.5  # a and b read 5 times; c only once
    assert held.pooled_spread() == pytest.approx(pooled)
    assert spreads["b"] == pytest.approx(pooled) and spreads["c"] == pytest.approx(pooled)
    assert held.ready()
    # the same renewal read twice is one reading
    again = HeldRecords(grace=30.0)
    same = read(0.0, s0=[("a", 10.0)])
    again.update(same, 0.0)
    again.update(same, 1.0)
    assert again.pooled_spread() is None and not again.ready()


def test_a_peer_on_a_new_stage_starts_a_new_history():
    held = HeldRecords(grace=30.0)
    for t, v in enumerate([10.0, 20.0, 10.0]):
        held.update(read(float(t), s0=[("a", v)]), float(t))
    assert held.pooled_spread() > 0.3
    for t, v in enumerate([5.0, 5.0], start=3):
        held.update(read(float(t), s1=[("a", v)]), float(t))
    assert held.pooled_spread() == 0.0
