"""Trainers' progress records are a stranger's word: bounded where read, signed, and kept apart per trainer."""

from __future__ import annotations

import json
import math

import pytest
from conftest import peer_flags, trainer_flags, wait_for_records
from hivemind.utils import get_dht_time

from swarm.net.dht_node import TetheredDHT
from swarm.records.stage_records import SERVING
from swarm.records.trainer_records import (
    MAX_ADDRESSES,
    MAX_BANNED,
    MAX_POINTS,
    RECORD_TTL,
    ProgressPoint,
    TrainerProgress,
    TrainerRecord,
    dropped_records,
    fetch_trainer_records,
    publish,
    trainers_key,
)

TRAINER = "12D3KooWCCxwv4TYQSH9TvqY5yqfLN57aG2hSPVbHBz7ZrHtywdp"
PEER = "12D3KooWHC2fW5dayrHQFixWeqLUbXSpBFYcsCEGbpuJWffMLvEE"


def sound(trainer: str = TRAINER, **changes) -> dict:
    record = TrainerRecord(
        trainer, "gpt-tiny", 2, 12, 96, 4.5, 30.0, 1, (PEER,), (ProgressPoint(1.7e9, 12, 4.5, 30.0),)
    )
    return {**record.to_value(), **changes}


def test_a_sound_record_parses_back_to_itself():
    record = TrainerRecord.from_value(sound(), 99.0)
    assert record is not None and record.to_value() == sound() and record.expiration == 99.0
    listening = sound(addresses=["/ip4/11.0.0.1/tcp/4100", "/ip6/::1/tcp/4100"])
    assert TrainerRecord.from_value(listening, 99.0).addresses == ("/ip4/11.0.0.1/tcp/4100", "/ip6/::1/tcp/4100")
    old = {k: v for k, v in sound().items() if k != "addresses"}  # from a trainer of before addresses
    assert TrainerRecord.from_value(old, 99.0).addresses == ()


@pytest.mark.parametrize(
    "changes",
    [
        {"loss": math.nan},
        {"loss": math.inf},
        {"loss": -1.0},
        {"samples_per_second": 1e12},
        {"samples_per_second": "fast"},
        {"step": -1},
        {"step": True},
        {"step": 2**60},
        {"num_stages": 0},
        {"peer_id": "not a peer id"},
        {"model": "x" * 1000},
        {"banned": ["not a peer id"]},
        {"banned": [PEER] * (MAX_BANNED + 1)},
        {"points": [[1.7e9, 1, math.nan, 1.0]]},
        {"points": [[1.7e9, 1, 1.0]]},
        {"points": [[1.7e9, -1, 1.0, 1.0]]},
        {"points": [[1.7e9, 1, 1.0, 1.0]] * (MAX_POINTS + 1)},
        {"points": "many"},
        {"addresses": ["/ip4/11.0.0.1/tcp/1/p2p/QmRelay/p2p-circuit"]},  # a relayed address is no direct road
        {"addresses": ["not a multiaddr"]},
        {"addresses": ["/ip4/11.0.0.1/udp/1"]},
        {"addresses": ["/ip4/11.0.0.1/tcp/1"] * (MAX_ADDRESSES + 1)},
        {"addresses": ["/ip4/11.0.0.1/tcp/" + "1" * 300]},
        {"addresses": "/ip4/11.0.0.1/tcp/1"},
    ],
)
def test_a_field_out_of_type_or_range_drops_the_record(changes):
    assert TrainerRecord.from_value(sound(**changes), 99.0) is None


def test_progress_keeps_the_last_points_and_measures_recent_samples_per_second():
    now = [100.0]
    progress = TrainerProgress(TRAINER, "gpt-tiny", 2, clock=lambda: now[0])
    for step in range(1, 61):
        now[0] += 1.0 if step <= 30 else 0.5  # 8 samples per step: 8/s, then 16/s
        progress.add_step(step, 5.0 - step / 100, 8, bans_issued=step // 10, banned=[PEER, "bogus"])
    record = TrainerRecord.from_value(progress.record().to_value(), 99.0)
    assert record is not None
    assert len(record.points) == MAX_POINTS and record.points[-1].step == 60 and record.step == 60
    assert record.samples == 480 and record.bans_issued == 6 and record.banned == (PEER,)
    assert record.samples_per_second == pytest.approx(16.0, rel=0.1)
    progress.add_step(61, math.nan, 8, 6, [])  # a NaN loss is no point, and never reaches the network
    assert progress.record().points[-1].step == 60


def test_records_are_read_signed_and_bounded_from_a_real_dht():
    """A forger can neither write under a trainer's key nor pass its own record off as the trainer's; a
    signed record out of bounds is skipped and counted."""
    honest = TetheredDHT(start=True)
    forger = TetheredDHT(initial_peers=[str(m) for m in honest.get_visible_maddrs()], start=True)
    try:
        mine = TrainerRecord.from_value(sound(str(honest.peer_id)), 0.0)
        assert publish(honest, "run", mine)
        claim = sound(str(honest.peer_id), loss=0.001)  # a loss the honest trainer never reached
        far = get_dht_time() + 600
        assert not forger.store(trainers_key("run"), claim, far, subkey=honest.identity.owner)
        assert forger.store(trainers_key("run"), claim, far, subkey=forger.identity.owner)
        hostile = sound(str(forger.peer_id), loss=math.inf)
        assert forger.store(trainers_key("other-run"), hostile, far, subkey=forger.identity.owner)
        before = dict(dropped_records)
        for reader in (honest, forger):
            records = fetch_trainer_records(reader, "run")
            assert [(r.peer_id, r.loss) for r in records] == [(str(honest.peer_id), 4.5)]
        assert fetch_trainer_records(honest, "other-run") == []
        assert dropped_records["unsigned"] >= before.get("unsigned", 0) + 2
        assert dropped_records["malformed"] >= before.get("malformed", 0) + 1
    finally:
        forger.shutdown()
        honest.shutdown()


@pytest.mark.timeout(300)
def test_a_trainer_that_finishes_leaves_its_final_step_in_its_record(local_swarm, tmp_path):
    """The record a trainer leaves when it ends names its last step, not the one its last periodic
    publish (every 2 s) happened to see."""
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(tmp_path / f"peer{stage}"))
    wait_for_records(local_swarm.initial_peers, lambda r: all(any(p.state == SERVING for p in r[s]) for s in range(3)))
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", trainer_flags(3, summary_file))
    assert trainer.wait(200) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    reader = TetheredDHT(initial_peers=local_swarm.initial_peers, start=True)
    try:
        (record,) = fetch_trainer_records(reader, "swarm")
    finally:
        reader.shutdown()
    assert record.step == summary["first_step"] + summary["steps"] == 3, record
    assert record.samples == summary["samples"] and record.loss == pytest.approx(summary["losses"][-1]), record
    # and that it finished, for longer than a training record lives: a stage short of its samples steps at once
    assert record.finished and record.expiration > get_dht_time() + RECORD_TTL, record
