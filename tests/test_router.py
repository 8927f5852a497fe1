"""The router, without a network: speed-weighted choice, bans, record merging."""

from __future__ import annotations

import random
from collections import Counter

from swarm.router import Router
from swarm.stage_records import LEAVING, SERVING, StageRecord


def record(peer: str, throughput: float = 10.0, state: str = SERVING, expiration: float = 100.0) -> StageRecord:
    return StageRecord(peer, 0, "gpt-tiny", 3, state, 0, throughput, 0, 32, 0, 2, expiration)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_choice_is_weighted_by_throughput():
    router = Router(rng=random.Random(0))
    router.update({0: [record("fast", 30.0), record("slow", 10.0)]}, now=0.0)
    counts = Counter(router.choose(0).peer_id for _ in range(20_000))
    assert abs(counts["fast"] / 20_000 - 0.75) < 0.02


def test_failing_peer_is_banned_with_backoff_until_the_ban_ends():
    clock = Clock()
    router = Router(rng=random.Random(0), clock=clock)
    router.update({0: [record("a"), record("b")]}, now=0.0)
    assert router.report_failure("a") == 1.0
    assert {router.choose(0).peer_id for _ in range(200)} == {"b"}
    clock.now = 1.5
    assert "a" in {router.choose(0).peer_id for _ in range(200)}
    assert router.report_failure("a") == 2.0  # consecutive failures double the ban
    router.report_success("a")
    assert router.report_failure("a") == 1.0


def test_records_survive_a_missed_read_until_they_expire_and_leaving_peers_get_no_work():
    router = Router()
    router.update({0: [record("a", expiration=10.0), record("b", expiration=10.0)]}, now=0.0)
    router.update({0: []}, now=5.0)  # a DHT read that found nothing
    assert {r.peer_id for r in router.live_peers(0)} == {"a", "b"}
    router.update({0: [record("b", state=LEAVING, expiration=12.0)]}, now=6.0)
    assert {r.peer_id for r in router.live_peers(0)} == {"a"}
    router.update({0: []}, now=11.0)
    assert router.live_peers(0) == [] and router.choose(0) is None
