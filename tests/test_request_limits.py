"""Request limits that fit the model: a peer's limits follow from its stage's boundary size and the largest
microbatch it accepts, which it announces; a trainer with larger microbatches sends them in parts."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_matches_reference, peer_flags, reference_run, run_p2p_client, trainer_flags
from hivemind.p2p import PeerID

from swarm.compression import get_codec
from swarm.models import get_model_spec
from swarm.net.dht_node import TetheredDHT
from swarm.net.request_limits import (
    CallTensors,
    call_bytes,
    largest_fitting_microbatch,
    reply_limits,
    request_limits,
    stage_limits,
    with_headroom,
)
from swarm.net.transport import StageCallError, call_stage
from swarm.net.wire import HEADER_BYTES, WireError, WireLimits, decode_tensors, encode_tensor, pack_frames, read_frames
from swarm.peer.checkpoint import load_checkpoint
from swarm.proto import BACKWARD, FORWARD, ErrorCode, StageRequest
from swarm.records.sample_ledger import account, read_ledger
from swarm.records.stage_records import LEAVING, SERVING, StageRecord, fetch_stage_records
from swarm.trainer.microbatch_split import plan_split

MiB = 2**20
PEER = "12D3KooWAbCdEfGhJkLmNpQrStUvWxYz123456789abcdefghi"


def stage_of(model: str, stage: int, num_stages: int = 3) -> SimpleNamespace:
    """What the limits read of a stage module, without building its parameters (gpt-medium's are large)."""
    spec = get_model_spec(model)
    is_first, is_last = stage == 0, stage == num_stages - 1
    takes_tokens = spec.later_stages_take_tokens and not is_first
    return SimpleNamespace(spec=spec, stage=stage, is_first=is_first, is_last=is_last, takes_tokens=takes_tokens)


# --- the pure computation --------------------------------------------------------------------------------------


def test_a_backward_carries_the_input_the_ids_and_the_output_gradient():
    assert CallTensors.backward_of(is_first=True, is_last=False, takes_tokens=False) == CallTensors(1, 1)
    assert CallTensors.backward_of(is_first=False, is_last=False, takes_tokens=False) == CallTensors(2, 0)
    assert CallTensors.backward_of(is_first=False, is_last=False, takes_tokens=True) == CallTensors(2, 1)
    assert CallTensors.backward_of(is_first=False, is_last=True, takes_tokens=False) == CallTensors(1, 1)
    assert CallTensors.backward_of(is_first=True, is_last=True, takes_tokens=False) == CallTensors(0, 2)
    payload, largest = call_bytes(CallTensors(2, 1), width=8, seq_len=4, samples=3, element_bytes=4)
    assert (payload, largest) == (2 * 3 * 4 * 8 * 4 + 3 * 4 * 8, 3 * 4 * 8 * 4)


def test_the_gpt_medium_microbatch_a_fixed_limit_refused_now_fits():
    # the case that stopped training: a backward of 32 samples carries 2 x 128 MiB in float32
    limits = stage_limits(stage_of("gpt-medium", 1), max_microbatch=32)
    assert WireLimits().max_message_bytes <= 2 * 128 * MiB < limits.wire.max_message_bytes < 2 * 128 * MiB * 1.03
    assert limits.wire.max_tensor_bytes == 128 * MiB
    assert limits.max_microbatch == limits.max_call_samples == 32
    assert limits.wire.max_parts * 512 * 1024 >= limits.wire.max_message_bytes  # parts never the tighter limit
    # a small model's limit shrinks with it: a peer of gpt-tiny no longer takes 256 MiB messages
    assert stage_limits(stage_of("gpt-tiny", 1), max_microbatch=256).wire.max_message_bytes < 20 * MiB


@pytest.mark.parametrize("cap", [5 * MiB, 8 * MiB, 100 * MiB + 12345])
def test_the_largest_fitting_microbatch_is_the_last_that_fits(cap):
    tensors = CallTensors(2, 1)
    samples = largest_fitting_microbatch(tensors, width=768, seq_len=512, max_message_bytes=cap)
    per_sample, _ = call_bytes(tensors, 768, 512, 1, 4)
    assert samples >= 1
    assert with_headroom(samples * per_sample) <= cap < with_headroom((samples + 1) * per_sample)
    assert largest_fitting_microbatch(tensors, 768, 512, max_message_bytes=MiB) == 0


def test_a_cap_replaces_the_model_limit_and_the_announced_microbatch_fits_it():
    limits = stage_limits(stage_of("gpt-tiny", 1), max_microbatch=256, max_request_bytes=8 * MiB)
    assert limits.wire.max_message_bytes == limits.wire.max_tensor_bytes == 8 * MiB
    assert limits.max_call_samples == 256  # a forward of more still fits the bytes: it is served
    assert 100 < limits.max_microbatch < 128  # a backward of 64 KiB a sample, within 8 MiB and headroom
    assert "--max-request-mb 8" in limits.wire.source


def encoded_backward(samples: int, codec: str = "none") -> bytes:
    """A backward to gpt-small's stage 1 of `samples` samples, as a trainer writes it."""
    hidden = torch.zeros(samples, 512, 768)
    parts = [p for t in (hidden, hidden) for p in encode_tensor(t, get_codec(codec))]
    frames = pack_frames(StageRequest(kind=BACKWARD, model="gpt-small", stage=1, microbatch_id=1), parts)
    return b"".join(f.nbytes.to_bytes(HEADER_BYTES, "big") + f.SerializeToString() for f in frames)


def read(data: bytes, limits: WireLimits) -> list[torch.Tensor]:
    async def go():
        reader = asyncio.StreamReader(limit=2**30)
        reader.feed_data(data)
        reader.feed_eof()
        _, parts = await read_frames(reader, StageRequest, limits)
        return decode_tensors(parts, limits)

    return asyncio.run(go())


def test_a_backward_of_the_announced_microbatch_is_read_and_one_sample_more_is_refused_naming_the_flag():
    limits = stage_limits(stage_of("gpt-small", 1), max_microbatch=4).wire
    tensors = read(encoded_backward(4), limits)
    assert [tuple(t.shape) for t in tensors] == [(4, 512, 768)] * 2
    with pytest.raises(WireError) as info:
        read(encoded_backward(5), limits)
    assert info.value.code == ErrorCode.TOO_LARGE
    assert "--max-microbatch 4" in str(info.value) and "--microbatch-size" in str(info.value), str(info.value)


def test_limits_without_a_source_say_what_they_said():
    limits = request_limits(CallTensors(2, 0), width=768, seq_len=512, max_microbatch=1, max_message_bytes=MiB)
    with pytest.raises(WireError) as info:
        read(encoded_backward(1), limits)
    assert str(info.value) == "message exceeds this peer's limit of 1.0 MiB"


# --- what peers announce, and the trainer's plan -------------------------------------------------------------


def record(stage: int, max_microbatch: int, state: str = SERVING, peer_id: str = PEER) -> StageRecord:
    return StageRecord(peer_id, stage, "gpt-tiny", 3, state, 0, 1.0, 0, 24, 0, 1, max_microbatch=max_microbatch)


def test_the_stage_record_carries_the_microbatch_and_old_records_stay_readable():
    value = record(1, 12).to_value()
    assert StageRecord.from_value(value, 1.0).max_microbatch == 12
    del value["max_microbatch"]  # a peer from before the field
    assert StageRecord.from_value(value, 1.0).max_microbatch == 0
    assert StageRecord.from_value({**value, "max_microbatch": -1}, 1.0) is None
    assert StageRecord.from_value({**value, "max_microbatch": "8"}, 1.0) is None


def test_the_trainer_splits_to_the_smallest_announced_and_says_which_flags_change_it():
    spec = get_model_spec("gpt-tiny")
    width, seq = spec.boundary_width, spec.seq_len
    records = {0: [record(0, 0)], 1: [record(1, 16), record(1, 3, LEAVING)], 2: [record(2, 4)]}
    plan = plan_split(8, records, width, seq, WireLimits().max_message_bytes)
    assert (plan.part_size, plan.parts, plan.stage, plan.announced) == (4, 2, 2, 4)
    notice = plan.notice()
    assert "--microbatch-size 4" in notice and "--max-microbatch 8" in notice and "stage 2" in notice, notice
    whole = plan_split(4, records, width, seq, WireLimits().max_message_bytes)
    assert whole.part_size == 4 and "whole" in whole.notice()
    # a peer from before the announcement (0) limits nothing
    assert plan_split(64, {0: [record(0, 0)]}, width, seq, WireLimits().max_message_bytes).part_size == 64


def test_the_trainer_also_splits_to_what_it_reads_in_one_reply():
    spec = get_model_spec("gpt-medium")  # a reply of 64 samples is 256 MiB: over the trainer's own limit
    plan = plan_split(64, {1: [record(1, 256)]}, spec.boundary_width, spec.seq_len, WireLimits().max_message_bytes)
    assert 32 <= plan.part_size < 64 and plan.peer_id == ""
    assert f"--microbatch-size {plan.part_size}" in plan.notice()
    # a trainer that reads each reply within limits sized to it splits for the peers alone
    assert plan_split(64, {1: [record(1, 256)]}, spec.boundary_width, spec.seq_len, 0).part_size == 64
    limits = reply_limits(spec.boundary_width, spec.seq_len, 64)
    assert 256 * MiB < limits.max_message_bytes < 256 * MiB * 1.03 and limits.max_tensor_bytes == 256 * MiB


# --- a real swarm ------------------------------------------------------------------------------------------------

STEPS, PEER_LIMIT, MICROBATCH = 3, 3, 6


def announced_and_refused(initial_peers: list[str]) -> tuple[list[int], StageCallError]:
    """The microbatch every peer announces, and stage 1's answer to a forward one sample over it."""
    dht = TetheredDHT(initial_peers=initial_peers, start=True)
    try:
        records = fetch_stage_records(dht, "swarm", 3)
    finally:
        dht.shutdown()
    announced = [r.max_microbatch for stage in range(3) for r in records[stage]]
    request = StageRequest(kind=FORWARD, model="gpt-tiny", stage=1)
    hidden = torch.randn(PEER_LIMIT + 1, 64, 128)

    async def go(p2p):
        peer = PeerID.from_base58(records[1][0].peer_id)
        try:
            await call_stage(p2p, peer, request, [hidden], get_codec("none"), timeout=30)
        except StageCallError as e:
            return e
        raise AssertionError("a call over the peer's --max-microbatch was served")

    return announced, run_p2p_client(initial_peers, go)


@pytest.mark.timeout(120)
def test_a_trainer_with_larger_microbatches_than_peers_accept_trains_exactly_in_parts(local_swarm, tmp_path):
    started = time.monotonic()
    checkpoints = tmp_path / "checkpoints"
    local_swarm.start_bootstrap()
    for stage in range(3):
        ledger = ["--ledger", str(tmp_path / f"peer{stage}.jsonl")]
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(checkpoints, "--max-microbatch", "3", *ledger))
    summary_file = tmp_path / "summary.json"
    flags = trainer_flags(STEPS, summary_file, microbatch_size=MICROBATCH) + ["--ledger", str(tmp_path / "fed.jsonl")]
    trainer = local_swarm.start_trainer("trainer", flags)
    assert trainer.wait(90) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    log = local_swarm.log_path("trainer").read_text()
    assert f"--microbatch-size {PEER_LIMIT}" in log and f"--max-microbatch {MICROBATCH}" in log, log[-3000:]

    announced, refused = announced_and_refused(local_swarm.initial_peers)
    assert announced == [PEER_LIMIT] * 3
    assert refused.code == ErrorCode.TOO_LARGE and "--max-microbatch" in refused.detail, refused.detail
    for stage in range(3):
        assert local_swarm.stop(f"peer{stage}") == 0  # a clean exit saves the checkpoint

    # every part a microbatch of its own, every sample fed and stepped on once
    fed = read_ledger(tmp_path / "fed.jsonl")
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == STEPS and {line["samples"] for line in fed} == {PEER_LIMIT}
    report = account(fed, read_ledger(tmp_path.glob("peer*.jsonl")))
    for stage in range(3):
        counts = report["stages"][stage]
        assert counts["samples_fed"] == counts["samples_stepped"] == summary["samples"], counts
        assert counts["samples_lost"] == counts["samples_doubled"] == 0, counts
    # the same global batches and the same gradients: the one-process reference's parameters
    reference = reference_run(STEPS, microbatch_size=PEER_LIMIT)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(reference.losses), rtol=1e-4, atol=1e-4)
    for stage, module in enumerate(reference.stages):
        checkpoint = load_checkpoint(checkpoints, "gpt-tiny", stage, 3)
        assert checkpoint is not None and checkpoint.step == STEPS
        assert_matches_reference(module, checkpoint.parameters, f"stage {stage}")
    print(f"swarm test took {time.monotonic() - started:.1f}s")
