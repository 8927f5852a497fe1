"""Bad input to a real peer: each gets a clear error to the caller, and the peer keeps serving."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from conftest import run_p2p_client
from hivemind.p2p import P2P, PeerID

from swarm.compression import get_codec
from swarm.net.dht_node import TetheredDHT
from swarm.net.transport import STAGE_PROTOCOL, StageCallError, call_stage, exchange, get_peer_info, open_stream
from swarm.net.wire import HEADER_BYTES, WireLimits, encode_tensor, pack_frames, read_frames
from swarm.proto import BACKWARD, FORWARD, PROTOCOL_VERSION, ErrorCode, StageReply, StageRequest
from swarm.records.stage_records import fetch_stage_records

D_MODEL, SEQ = 128, 64  # gpt-tiny
NONE = get_codec("none")


@pytest.fixture(scope="module")
def stage1_peer(tmp_path_factory):
    """Bootstrap node and one peer hosting stage 1 of 3, limited to 8 MiB requests."""
    from swarm.launch.local_swarm import LocalSwarm

    swarm = LocalSwarm(tmp_path_factory.mktemp("peer-errors"))
    try:
        swarm.start_bootstrap()
        process = swarm.start_peer("peer1", 1, ["--max-request-mb", "8"])
        dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)
        try:
            deadline = time.monotonic() + 90
            while not (records := fetch_stage_records(dht, "swarm", 3)[1]):
                assert process.poll() is None, swarm.log_path("peer1").read_text()
                assert time.monotonic() < deadline, "peer did not announce itself"
                time.sleep(0.5)
        finally:
            dht.shutdown()
        yield swarm, records[0].peer_id, process
    finally:
        swarm.stop_all()


def run_client(swarm, coroutine_fn):
    return run_p2p_client(swarm.initial_peers, coroutine_fn)


def request(stage: int = 1, **fields) -> StageRequest:
    return StageRequest(kind=FORWARD, model="gpt-tiny", stage=stage, **fields)


def call(swarm, peer_id: str, req: StageRequest, tensors: list[torch.Tensor]):
    async def go(p2p):
        return await call_stage(p2p, PeerID.from_base58(peer_id), req, tensors, NONE, timeout=60)

    return run_client(swarm, go)


def expect_error(swarm, peer_id, req, tensors, code: int, *words: str) -> None:
    with pytest.raises(StageCallError) as info:
        call(swarm, peer_id, req, tensors)
    assert info.value.code == code, str(info.value)
    for word in words:
        assert word in info.value.detail, info.value.detail


def assert_still_serving(swarm, peer_id, process) -> None:
    reply, (out,) = call(swarm, peer_id, request(), [torch.randn(2, SEQ, D_MODEL)])
    assert out.shape == (2, SEQ, D_MODEL) and reply.error.code == ErrorCode.OK
    assert process.poll() is None


def test_valid_forward_and_info(stage1_peer):
    swarm, peer_id, process = stage1_peer
    assert_still_serving(swarm, peer_id, process)

    async def info(p2p):
        return await get_peer_info(p2p, PeerID.from_base58(peer_id))

    peer_info = run_client(swarm, info)
    assert (peer_info.stage, peer_info.num_stages, peer_info.model, peer_info.state) == (
        1,
        3,
        "gpt-tiny",
        "serving",
    )


@pytest.mark.parametrize("codec", ["fp16", "8bit"])
def test_compressed_both_ways(stage1_peer, codec):
    """Activations go out in the caller's codec and come back in it; backward gradients too."""
    swarm, peer_id, _ = stage1_peer
    hidden, grad = torch.randn(4, SEQ, D_MODEL), torch.randn(4, SEQ, D_MODEL)
    for kind, tensors in ((FORWARD, [hidden]), (BACKWARD, [hidden, grad])):
        req = StageRequest(protocol_version=PROTOCOL_VERSION, kind=kind, model="gpt-tiny", stage=1)
        parts = [p for t in tensors for p in encode_tensor(t, get_codec(codec))]
        assert {p.head.codec for p in parts if p.head.shape} == {codec}
        reply, reply_parts = run_client(
            swarm,
            lambda p2p, req=req, parts=parts: exchange(
                p2p, PeerID.from_base58(peer_id), STAGE_PROTOCOL, pack_frames(req, parts), StageReply, WireLimits()
            ),
        )
        assert reply.error.code == ErrorCode.OK, reply.error.message
        assert [p.head.codec for p in reply_parts if p.head.shape] == [codec]
        full = sum(len(p.buffer) for p in encode_tensor(tensors[0], NONE))
        assert sum(len(p.buffer) for p in reply_parts) < 0.6 * full


def test_tensor_over_4mib_is_served(stage1_peer):
    swarm, peer_id, process = stage1_peer
    hidden = torch.randn(160, SEQ, D_MODEL)  # 5 MiB: above p2pd's 4 MiB unary message limit
    _, (out,) = call(swarm, peer_id, request(), [hidden])
    assert out.shape == hidden.shape and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "tensors, words",
    [
        ([torch.randn(2, SEQ, 64)], ["float32[2, 64, 128]", "float32[2, 64, 64]"]),  # wrong width
        ([torch.randn(2, SEQ, D_MODEL).double()], ["float32", "float64"]),  # wrong dtype
        ([torch.randn(2, SEQ + 1, D_MODEL)], ["sequence length"]),  # longer than the model's context
        ([torch.randint(0, 5, (2, SEQ))], ["hidden must be"]),  # tokens sent to a middle stage
        ([torch.randn(2, SEQ, D_MODEL)] * 2, ["takes 1 tensors"]),  # too many tensors
        ([torch.full((1, SEQ, D_MODEL), float("nan"))], ["NaN"]),
        ([torch.full((1, SEQ, D_MODEL), 3e38)], ["magnitude 3e+38"]),  # finite, but no activation
    ],
    ids=["shape", "dtype", "seq_len", "tokens", "count", "nan", "huge"],
)
def test_bad_tensors_get_clear_errors(stage1_peer, tensors, words):
    swarm, peer_id, process = stage1_peer
    expect_error(swarm, peer_id, request(), tensors, ErrorCode.BAD_REQUEST, *words)
    assert_still_serving(swarm, peer_id, process)


def test_huge_and_nan_gradients_are_refused_and_the_parameters_stay_as_they_were(stage1_peer):
    swarm, peer_id, process = stage1_peer

    def info():
        return run_client(swarm, lambda p2p: get_peer_info(p2p, PeerID.from_base58(peer_id)))

    before = info()
    hidden = torch.randn(2, SEQ, D_MODEL)
    for value in (3e38, float("nan")):
        backward = StageRequest(kind=BACKWARD, model="gpt-tiny", stage=1, microbatch_id=7)
        expect_error(swarm, peer_id, backward, [hidden, torch.full_like(hidden, value)], ErrorCode.BAD_REQUEST)
    after = info()
    assert (after.fingerprint, after.samples_accumulated, after.step) == (
        before.fingerprint,
        before.samples_accumulated,
        before.step,
    )
    reply, (out,) = call(swarm, peer_id, request(), [hidden])
    assert bool(torch.isfinite(out).all())


def test_wrong_stage_and_model(stage1_peer):
    swarm, peer_id, process = stage1_peer
    hidden = [torch.randn(1, SEQ, D_MODEL)]
    expect_error(swarm, peer_id, request(stage=2), hidden, ErrorCode.WRONG_STAGE, "hosts stage 1")
    req = request()
    req.model = "gpt-small"
    expect_error(swarm, peer_id, req, hidden, ErrorCode.WRONG_STAGE, "gpt-tiny")
    assert_still_serving(swarm, peer_id, process)


def test_tensor_far_over_the_size_limit(stage1_peer):
    swarm, peer_id, process = stage1_peer
    # 16 MiB really sent, against the peer's 8 MiB limit
    expect_error(swarm, peer_id, request(), [torch.randn(512, SEQ, D_MODEL)], ErrorCode.TOO_LARGE, "limit")
    assert_still_serving(swarm, peer_id, process)


async def raw_exchange(p2p: P2P, peer_id: str, data: bytes) -> StageReply:
    """Writes raw bytes on a stage stream and reads the peer's framed reply."""
    reader, writer = await open_stream(p2p, PeerID.from_base58(peer_id), STAGE_PROTOCOL)
    try:
        writer.write(data)
        await writer.drain()
        reply, _ = await asyncio.wait_for(read_frames(reader, StageReply, WireLimits()), 30)
        return reply
    finally:
        writer.close()


def test_malformed_bytes(stage1_peer):
    swarm, peer_id, process = stage1_peer
    garbage = b"\x0a\xff\xff\xff\xff\x0f garbage that is no protobuf"
    reply = run_client(
        swarm, lambda p2p: raw_exchange(p2p, peer_id, len(garbage).to_bytes(HEADER_BYTES, "big") + garbage)
    )
    assert reply.error.code == ErrorCode.BAD_REQUEST and "malformed" in reply.error.message
    # a frame that claims to be a terabyte is refused without reading it
    reply = run_client(swarm, lambda p2p: raw_exchange(p2p, peer_id, (2**40).to_bytes(HEADER_BYTES, "big")))
    assert reply.error.code == ErrorCode.TOO_LARGE
    # a tensor header that claims far more data than the limit, with a tiny buffer
    head = encode_tensor(torch.zeros(1), NONE)[0]
    del head.head.shape[:]
    head.head.shape.extend([2**20, 2**20])
    frame = pack_frames(request(protocol_version=PROTOCOL_VERSION), [head])[0].SerializeToString()
    reply = run_client(swarm, lambda p2p: raw_exchange(p2p, peer_id, len(frame).to_bytes(HEADER_BYTES, "big") + frame))
    assert reply.error.code == ErrorCode.TOO_LARGE
    assert_still_serving(swarm, peer_id, process)


def test_protocol_version_mismatch(stage1_peer):
    swarm, peer_id, process = stage1_peer
    parts = encode_tensor(torch.randn(1, SEQ, D_MODEL), NONE)
    frames = pack_frames(request(protocol_version=PROTOCOL_VERSION + 41), parts)

    async def go(p2p):
        return await exchange(p2p, PeerID.from_base58(peer_id), STAGE_PROTOCOL, frames, StageReply, WireLimits())

    reply, _ = run_client(swarm, go)
    assert reply.error.code == ErrorCode.VERSION_MISMATCH and "upgrade" in reply.error.message
    assert_still_serving(swarm, peer_id, process)
