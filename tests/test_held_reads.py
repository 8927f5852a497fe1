"""A keeper's reads of the stages it holds copies of: every period in the calm, every few while it follows them,
with the last records standing in between."""

from __future__ import annotations

from swarm.peer.held_reads import HELD_READ_EVERY, HeldReads
from swarm.records.stage_records import SERVING, StageRecord


def record(peer: str, stage: int, step: int) -> StageRecord:
    return StageRecord(
        peer_id=peer,
        stage=stage,
        model="gpt-tiny",
        num_stages=3,
        state=SERVING,
        step=step,
        throughput=1.0,
        queue_length=0,
        target_batch_size=32,
        stale_gradients=0,
        protocol_version=1,
        expiration=100.0 + step,
    )


def test_in_the_calm_every_held_stage_is_read_every_period():
    reads = HeldReads()
    reads.merge(1, {1: [record("a", 1, 5)], 2: [record("b", 2, 5)]}, [1, 2])
    assert reads.wanted(2, [1, 2], following=False) == [1, 2]


def test_while_following_a_held_stage_is_read_every_few_periods_and_its_last_records_stand_in():
    reads = HeldReads()
    assert reads.wanted(1, [1, 2], following=True) == [1, 2]  # nothing read yet
    first = {0: [record("me", 0, 7)], 1: [record("a", 1, 7)], 2: [record("b", 2, 7)]}
    assert reads.merge(1, first, [1, 2]) == first
    for period in range(2, 1 + HELD_READ_EVERY):
        assert reads.wanted(period, [1, 2], following=True) == []
        merged = reads.merge(period, {0: [record("me", 0, 8)]}, [1, 2])
        assert merged == {0: [record("me", 0, 8)], 1: first[1], 2: first[2]}
        assert reads.stood_in(1, period) and reads.stood_in(2, period)  # the catch-up asks their peers how far
    assert reads.wanted(1 + HELD_READ_EVERY, [1, 2], following=True) == [1, 2]
    # a read replaces what stood in; an empty read is a read too (the stage's peers are gone)
    merged = reads.merge(1 + HELD_READ_EVERY, {1: [record("c", 1, 9)], 2: []}, [1, 2])
    assert merged == {1: [record("c", 1, 9)], 2: []}
    assert not reads.stood_in(1, 1 + HELD_READ_EVERY) and not reads.stood_in(2, 1 + HELD_READ_EVERY)


def test_a_stage_no_longer_held_is_forgotten_and_one_newly_held_is_read_at_once():
    reads = HeldReads()
    reads.merge(1, {1: [record("a", 1, 3)], 2: [record("b", 2, 3)]}, [1, 2])
    assert reads.merge(2, {}, [1]) == {1: [record("a", 1, 3)]}
    assert reads.wanted(2, [1, 3], following=True) == [3]
    assert reads.wanted(3, [1, 2], following=True) == [2]
