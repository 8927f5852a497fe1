"""DHT records are read as a stranger's word: any field out of type or range drops the record, counted."""

from __future__ import annotations

import math
import time

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.router import Router
from swarm.stage_records import (
    SERVING,
    StageRecord,
    announce,
    dropped_records,
    fetch_stage_records,
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
    ],
)
def test_a_field_out_of_type_or_range_drops_the_record(changes):
    assert StageRecord.from_value(sound(**changes), 99.0) is None


def test_records_out_of_range_in_a_real_dht_are_skipped_counted_and_never_reach_the_router():
    dht = DHT(start=True)
    try:
        expiration = get_dht_time() + 30
        dht.store(stage_key("swarm", 1), sound(throughput=math.nan), expiration, subkey=PEER)
        announce(dht, "swarm", StageRecord.from_value(sound(OTHER), 0.0), ttl=30)
        before = sum(dropped_records.values())
        deadline = time.monotonic() + 20
        while len(fetch_stage_records(dht, "swarm", 3)[1]) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        records = fetch_stage_records(dht, "swarm", 3)
        assert [r.peer_id for r in records[1]] == [OTHER]
        assert sum(dropped_records.values()) > before
        router = Router()
        router.update(records, get_dht_time())
        assert router.choose(1).peer_id == OTHER  # a NaN throughput never gets here to break the choice
    finally:
        dht.shutdown()
