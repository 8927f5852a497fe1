"""DHT records are read as a stranger's word: any field out of type or range drops the record, counted."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
from hivemind.utils import get_dht_time

from swarm.net.dht_node import TetheredDHT
from swarm.policy.router import Router
from swarm.records.stage_records import (
    SERVING,
    StageRecord,
    announce,
    dropped_records,
    fetch_stage_records,
    reported_liars,
    stage_key,
)

PEER = "12D3KooWCCxwv4TYQSH9TvqY5yqfLN57aG2hSPVbHBz7ZrHtywdp"
OTHER = "12D3KooWHC2fW5dayrHQFixWeqLUbXSpBFYcsCEGbpuJWffMLvEE"


def sound(peer: str = PEER, **changes) -> dict:
    record = StageRecord(peer, 1, "gpt-tiny", 3, SERVING, 7, 120.0, 2, 32, 0, 3)
    return {**record.to_value(), **changes}


def test_a_sound_record_parses():
    assert StageRecord.from_value(sound(), 99.0) == StageRecord(
        PEER, 1, "gpt-tiny", 3, SERVING, 7, 120.0, 2, 32, 0, 3, 99.0
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"throughput": math.nan},
        {"throughput": math.inf},
        {"throughput": -1.0},
        {"throughput": 1e12},
        {"step": -1},
        {"step": 2**63},
        {"stage": 3},  # the model has 3 stages: 0..2
        {"num_stages": 0},
        {"queue_length": -5},
        {"target_batch_size": 0},
        {"step": True},
        {"peer_id": "not a peer id"},
        {"model": "x" * 1000},
        {"state": "hacked"},
        {"caught": ["not a peer id"]},
        {"caught": [OTHER] * 17},
        {"caught": OTHER},
        {"stage_blocks": [2, 4]},  # not one count per stage
        {"stage_blocks": [2, 0, 4]},
        {"stage_blocks": "2,2,2"},
        {"stage_blocks": [2, 2.5, 2]},
        {"versions": [[3, "not a hash"]]},
        {"versions": [[3, ""]]},
        {"versions": [[-1, "a" * 16]]},
        {"versions": [[3, "a" * 16]] * 9},
        {"versions": "3"},
        {"empty": [3]},
        {"empty": "1"},
        {"empty": [1, 1, 1, 1]},
    ],
)
def test_a_field_out_of_type_or_range_drops_the_record(changes):
    assert StageRecord.from_value(sound(**changes), 99.0) is None


def test_an_uneven_cut_is_announced_and_read_back():
    record = StageRecord.from_value(sound(stage_blocks=[1, 2, 3]), 99.0)
    assert record is not None and record.stage_blocks == (1, 2, 3)
    assert StageRecord.from_value(record.to_value(), 99.0) == record


def test_trainers_leave_out_a_mate_two_others_caught_lying_never_one_named_by_one():
    third = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    liar, honest = PEER, OTHER
    records = [
        StageRecord.from_value(sound(liar, caught=[honest]), 99.0),  # a lone insider naming an honest mate
        StageRecord.from_value(sound(honest, caught=[liar]), 99.0),
        StageRecord.from_value(sound(third, caught=[liar]), 99.0),
    ]
    assert reported_liars(records) == {liar}
    router = Router()
    router.update({1: records}, now=0.0)
    assert {r.peer_id for r in router.live_peers(1)} == {honest, third}
    assert reported_liars(records[:2]) == set()  # one report is one peer's word


def signed(dht: TetheredDHT, **changes) -> StageRecord:
    """A record of `dht`'s own peer, which its key signs when announced."""
    return StageRecord(**{**sound(str(dht.peer_id)), **changes})


def test_records_out_of_range_in_a_real_dht_are_skipped_counted_and_never_reach_the_router():
    honest = TetheredDHT(start=True)
    hostile = TetheredDHT(initial_peers=[str(m) for m in honest.get_visible_maddrs()], start=True)
    try:
        assert announce(hostile, "swarm", signed(hostile, throughput=math.nan), ttl=30)  # signed, but absurd
        assert announce(honest, "swarm", signed(honest), ttl=30)
        before = dropped_records["malformed"]
        records = fetch_stage_records(honest, "swarm", 3)
        assert [r.peer_id for r in records[1]] == [str(honest.peer_id)]
        assert dropped_records["malformed"] > before
        router = Router()
        router.update(records, get_dht_time())
        assert router.choose(1).peer_id == str(honest.peer_id)  # a NaN throughput never gets here to break the choice
    finally:
        hostile.shutdown()
        honest.shutdown()


def test_nobody_can_write_or_shadow_another_peers_record():
    """A forger's record claiming an honest peer's id: under the honest peer's key it is refused at store
    (unsigned), under the forger's own key or a plain subkey it is stored but skipped where it is read."""
    honest = TetheredDHT(start=True)
    forger = TetheredDHT(initial_peers=[str(m) for m in honest.get_visible_maddrs()], start=True)
    try:
        assert announce(honest, "swarm", signed(honest, step=7), ttl=30)
        claim = signed(honest, step=1000).to_value()  # the honest peer's id, a step that would make mates resync
        far = get_dht_time() + 600
        assert not forger.store(stage_key("swarm", 1), claim, far, subkey=honest.identity.owner)
        assert forger.store(stage_key("swarm", 1), claim, far, subkey=forger.identity.owner)
        assert forger.store(stage_key("swarm", 1), claim, far, subkey=str(honest.peer_id))
        before = dropped_records["unsigned"]
        for reader in (honest, forger):
            records = fetch_stage_records(reader, "swarm", 3)[1]
            assert [(r.peer_id, r.step) for r in records] == [(str(honest.peer_id), 7)]
        assert dropped_records["unsigned"] >= before + 4
    finally:
        forger.shutdown()
        honest.shutdown()


def test_a_read_from_a_dht_node_that_stopped_answering_fails_within_its_timeout_not_never():
    """The process's DHT node stuck (here: stopped): a trainer waiting on a stage must still reach its own deadline
    and say why, so a read gives up with TimeoutError rather than wait on the node forever."""
    node = TetheredDHT(start=True)
    try:
        assert fetch_stage_records(node, "swarm", 3, timeout=10.0) == {0: [], 1: [], 2: []}
        os.kill(node.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="has not answered a read"):
            fetch_stage_records(node, "swarm", 3, timeout=2.0)
        assert time.monotonic() - started < 10.0
    finally:
        os.kill(node.pid, signal.SIGCONT)
        node.shutdown()
