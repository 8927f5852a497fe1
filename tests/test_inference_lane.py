"""Inference on a training peer, without a network: the KV cache, the background lane below training, what
inference leaves untouched, the sessions' bounds, and malformed INFER calls."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.compression import get_codec
from swarm.models import build_stage, get_model_spec
from swarm.models.kv_cache import StageCache
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.net.wire import WireLimits, encode_tensor
from swarm.peer.inference_handler import InferenceHandler
from swarm.peer.inference_sessions import InferenceSessions, SessionError
from swarm.peer.inference_work import InferenceWork
from swarm.peer.runtime import StageRuntime
from swarm.proto import INFER, ErrorCode, StageReply, StageRequest

SPEC = get_model_spec("gpt-tiny")


def make_runtime(stage: int = 1, speed: float = 0.0) -> StageRuntime:
    module = build_stage(SPEC, stage, 3, seed=1)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), 8, simulated_speed=speed)
    runtime.start()
    return runtime


def hidden(batch: int, seq: int = SPEC.seq_len, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, seq, SPEC.d_model, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model", ["gpt-tiny", "gpt-tiny-subspace", "gpt-tiny-bottleneck", "llama-tiny"])
def test_a_cached_session_predicts_what_the_whole_sequence_does(model):
    spec = get_model_spec(model)
    stages = [build_stage(spec, stage, 3, seed=2).eval() for stage in range(3)]
    tokens = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(1))

    def through(chunk: torch.Tensor, caches=None) -> torch.Tensor:
        out = chunk
        for stage, cache in zip(stages, caches or [None] * 3):
            extra = {"cache": cache} if cache is not None else {}
            out = stage(out, tokens=chunk if stage.takes_tokens else None, **extra)
        return stages[-1].logits(out)

    with torch.inference_mode():
        whole = through(tokens)
        caches = [StageCache(len(stage.blocks)) for stage in stages]
        pieces = [through(tokens[:, a:b], caches) for a, b in ((0, 6), (6, 7), (7, 8), (8, 15), (15, 21))]
    assert caches[0].length == 21
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_a_training_request_goes_before_the_rest_of_an_inference_job():
    runtime = make_runtime(speed=400.0)  # a forward of one sample takes 1/1200 s: a long job has many chunks
    work = InferenceWork(runtime, chunk_seconds=0.005)
    runtime.speed.reset(1 / 400)
    try:
        # queued first, about 0.2 s of chunks: it cannot end while the training request queued after it runs
        inferring = work.submit([hidden(256)])
        training = runtime.submit(True, [hidden(2, seed=1), hidden(2, seed=2)], key=("t", 1))
        training.result(timeout=30)
        assert not inferring.done(), "the training request waited for the whole inference job"
        result = inferring.result(timeout=60)
        assert result.output.shape == (256, SPEC.seq_len, SPEC.d_model)
        assert work.chunks > 4
        delays = runtime.requests.inference_delays
        assert len(delays) <= 1 and all(d < 1.0 for d in delays)  # at most the chunk under way, no more
    finally:
        runtime.shutdown()


def test_inference_leaves_the_gradients_the_held_samples_and_the_step_as_they_were():
    runtime = make_runtime()
    work = InferenceWork(runtime)
    try:
        runtime.submit(True, [hidden(2, seed=1), hidden(2, seed=2)], key=("t", 1)).result(timeout=30)
        grads = [p.grad.clone() for p in runtime.module.parameters()]
        held, step = dict(runtime.held), runtime.step
        cache = StageCache(len(runtime.module.blocks))
        result = work.submit([hidden(1, 10)], cache=cache).result(timeout=30)
        work.submit([hidden(3)]).result(timeout=30)
        assert result.output.shape == (1, 10, SPEC.d_model) and cache.length == 10 and result.step == step
        assert all(torch.equal(p.grad, g) for p, g in zip(runtime.module.parameters(), grads))
        assert runtime.held == held and runtime.step == step and runtime.samples_accumulated == 2
    finally:
        runtime.shutdown()


def test_the_last_stage_answers_losses_with_targets_and_next_token_logits_without():
    runtime = make_runtime(stage=2)
    work = InferenceWork(runtime)
    try:
        targets = torch.randint(0, 256, (3, SPEC.seq_len))
        losses = work.submit([hidden(3)], targets=targets).result(timeout=30).output
        logits = work.submit([hidden(3)]).result(timeout=30).output
        assert losses.shape == (3,) and logits.shape == (3, SPEC.vocab_size)
    finally:
        runtime.shutdown()


@pytest.mark.parametrize("stage, targets", [(1, False), (2, False), (2, True)])
def test_a_sample_longer_than_a_chunk_is_cut_along_its_sequence_and_answers_as_a_whole(stage, targets):
    runtime = make_runtime(stage)
    runtime.speed.reset(0.03)  # a sample's forward: 10 ms, against 1 ms chunks: 6 positions a chunk
    cut, whole = InferenceWork(runtime, chunk_seconds=0.001), InferenceWork(runtime, chunk_seconds=1.0)
    target_ids = torch.randint(0, 256, (3, SPEC.seq_len)) if targets else None
    try:
        assert cut.samples_per_chunk() == 0 and cut.positions_per_chunk(1) == 6
        by_chunks = cut.submit([hidden(3)], target_ids).result(timeout=60).output
        at_once = whole.submit([hidden(3)], target_ids).result(timeout=60).output
        assert cut.chunks == 3 * 11 and whole.chunks == 1
        torch.testing.assert_close(by_chunks, at_once, atol=1e-5, rtol=1e-5)
    finally:
        runtime.shutdown()


def test_sessions_are_kept_per_caller_bounded_and_lost_sessions_say_so():
    sessions = InferenceSessions(num_blocks=2, seq_len=64, max_bytes=10**9, per_caller=2)
    cache = sessions.take("alice", "s1", 0, 5)
    cache.length = 5
    sessions.release("alice", "s1")
    with pytest.raises(SessionError) as lost:
        sessions.take("bob", "s1", 5, 1)  # another caller's session of the same name is not reachable
    assert lost.value.code == ErrorCode.SESSION_LOST
    with pytest.raises(SessionError) as lost:
        sessions.take("alice", "s1", 4, 1)
    assert lost.value.code == ErrorCode.SESSION_LOST
    assert sessions.take("alice", "s1", 5, 1) is cache
    with pytest.raises(SessionError):  # one call of a session at a time
        sessions.take("alice", "s1", 5, 1)
    sessions.release("alice", "s1")
    sessions.release(*("alice", "s2"))
    sessions.take("alice", "s2", 0, 1)
    sessions.release("alice", "s2")
    with pytest.raises(SessionError) as full:
        sessions.take("alice", "s3", 0, 1)
    assert full.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(SessionError) as long:
        sessions.take("bob", "s4", 60, 5)
    assert long.value.code == ErrorCode.BAD_REQUEST
    sessions.idle_seconds = -1.0  # every idle one is past it
    sessions.take("bob", "s5", 0, 1)  # the idle ones expire
    assert len(sessions) == 1


def test_sessions_over_the_byte_bound_give_up_the_least_recently_used():
    sessions = InferenceSessions(num_blocks=1, seq_len=64, max_bytes=1500)
    for name in ("a", "b"):
        cache = sessions.take("alice", name, 0, 1)
        cache.layers[0].extend(torch.zeros(1, 1, 1, 100), torch.zeros(1, 1, 1, 100))  # 800 bytes
        sessions.release("alice", name)
    assert len(sessions) == 1 and sessions.dropped == 1
    with pytest.raises(SessionError):
        sessions.take("alice", "a", 1, 1)


def test_a_malformed_infer_call_is_answered_with_a_clear_error():
    runtime = make_runtime()
    sessions = InferenceSessions(len(runtime.module.blocks), SPEC.seq_len, 10**8)
    handler = InferenceHandler(runtime, WireLimits(), 16, InferenceWork(runtime), sessions)

    def error(code: int, message: str) -> StageReply:
        reply = StageReply()
        reply.error.code, reply.error.message = code, message
        return reply

    async def ask(tensors: list[torch.Tensor], **fields) -> StageReply:
        parts = [p for t in tensors for p in encode_tensor(t, get_codec("none"))]
        request = StageRequest(kind=INFER, model=SPEC.name, stage=1, **fields)
        return (await handler.serve(request, parts, "caller", None, error))[0]

    try:
        wrong_width = asyncio.run(ask([torch.randn(1, 8, 7)]))
        assert wrong_width.error.code == ErrorCode.BAD_REQUEST and "hidden" in wrong_width.error.message
        nan = torch.full((1, 8, SPEC.d_model), float("nan"))
        assert asyncio.run(ask([nan])).error.code == ErrorCode.BAD_REQUEST
        lost = asyncio.run(ask([hidden(1, 4)], session="s", position=3))
        assert lost.error.code == ErrorCode.SESSION_LOST
        asyncio.run(ask([hidden(1, 4)], session="s"))  # the reply's frames
        assert handler.served == 1 and len(sessions) == 1 and sessions.take("caller", "s", 4, 1).length == 4
    finally:
        runtime.shutdown()
