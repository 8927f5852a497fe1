"""The peer's side of INFER calls: forward-only requests served from the live weights, below training.

`StageHandler` hands an INFER call here once the call is for this stage and the peer serves. Its tensors
are checked as a forward's (on the last stage, with targets, as a backward's: inputs and targets), then run
by `InferenceWork` in the runtime's background lane. A call that names a session extends that session's KV
cache (`InferenceSessions`); a peer that spills its blocks (--offload) keeps none and says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from swarm.compression import CodecError, get_codec
from swarm.config import PeerConfig
from swarm.models.stage_io import StageInputError, check_stage_inputs, value_problem
from swarm.net.link_shaper import SharedLink
from swarm.net.request_limits import undecoded_problem
from swarm.net.uplink_turns import UplinkTurns
from swarm.net.wire import Part, WireLimits, codes_inline, decode_tensors, encode_tensor, pack_frames
from swarm.peer.inference_sessions import InferenceSessions, SessionError
from swarm.peer.inference_work import InferenceResult, InferenceWork
from swarm.peer.runtime import QueueFullError, StageRuntime
from swarm.proto import PROTOCOL_VERSION, ErrorCode, PeerInfo, StageReply, StageRequest

MAX_SESSION_NAME = 128  # characters of a session's name

ErrorReply = Callable[[int, str], StageReply]


class InferenceHandler:
    """Serves one stage's INFER calls (see the module's docstring)."""

    def __init__(
        self,
        runtime: StageRuntime,
        limits: WireLimits,
        max_batch_samples: int,
        work: InferenceWork,
        sessions: InferenceSessions | None,
    ) -> None:
        self.runtime = runtime
        self.limits = limits
        self.max_batch_samples = max_batch_samples
        self.work = work
        self.sessions = sessions  # None: a spilling peer, which runs its blocks a group at a time, keeps no cache
        self.served = 0

    async def serve(
        self, request: StageRequest, parts: list[Part], caller: str, give_up_at: float | None, error: ErrorReply
    ) -> list[StageReply]:
        """The reply frames to one INFER call; `error` makes (and counts) an error reply."""
        stage = self.runtime.module
        if len(request.session) > MAX_SESSION_NAME:
            return [error(ErrorCode.BAD_REQUEST, f"a session's name is at most {MAX_SESSION_NAME} characters")]
        if request.session and self.sessions is None:
            return [error(ErrorCode.BAD_REQUEST, "this peer spills its stage (--offload) and keeps no session")]
        if request.end_session and not parts:
            ended = self.sessions is not None and self.sessions.end(caller, request.session)
            return [StageReply(protocol_version=PROTOCOL_VERSION, step=self.runtime.step, num_samples=int(ended))]
        targets = stage.is_last and not request.session and len(parts) == stage.num_inputs + 1
        tensors, problem = await self._decode(parts, targets)
        if problem is not None:
            return [error(*problem)]
        try:
            codec = get_codec(request.reply_codec or parts[0].head.codec or "none")
        except CodecError as e:
            return [error(ErrorCode.BAD_REQUEST, f"reply codec: {e}")]
        inputs = tensors[: stage.num_inputs]
        cache = None
        if request.session:
            try:
                cache = self.sessions.take(caller, request.session, request.position, inputs[0].shape[1])
            except SessionError as e:
                return [error(e.code, str(e))]
        failed = True
        try:
            submitted = self.work.submit(inputs, tensors[-1] if targets else None, cache, give_up_at)
            result: InferenceResult = await asyncio.wrap_future(submitted)
            failed = False
        except QueueFullError as e:
            return [error(ErrorCode.UNAVAILABLE, str(e))]
        except RuntimeError as e:
            return [error(ErrorCode.UNAVAILABLE, str(e))]
        finally:
            if cache is not None:
                self.sessions.release(caller, request.session, failed=failed, end=request.end_session)
        if not stage.is_last and (bad := value_problem(result.output)):
            return [error(ErrorCode.INTERNAL, f"this peer computed values that {bad}; its state is broken")]
        return self._reply(result, inputs[0].shape[0], targets, codec)

    async def _decode(self, parts: list[Part], targets: bool) -> tuple[list[torch.Tensor], tuple[int, str] | None]:
        """The call's tensors, checked against the stage's shapes before and after decoding, or what is wrong."""
        stage, dtype = self.runtime.module, self.runtime.dtype

        def take() -> tuple[list[torch.Tensor], tuple[int, str] | None]:
            if (problem := undecoded_problem(stage, targets, parts, self.max_batch_samples, dtype)) is not None:
                return [], problem
            tensors = decode_tensors(parts, self.limits)
            try:
                check_stage_inputs(stage, targets, tensors, self.max_batch_samples, dtype)
            except StageInputError as e:
                return tensors, (ErrorCode.BAD_REQUEST, str(e))
            return tensors, None

        received = sum(len(part.buffer) for part in parts)
        if codes_inline([part.head.codec for part in parts], received):
            return take()
        return await asyncio.get_running_loop().run_in_executor(None, take)

    def _reply(self, result: InferenceResult, samples: int, targets: bool, codec) -> list[StageReply]:
        """Hidden states travel in the caller's codec; logits and losses, small and read as they are, exactly."""
        reply = StageReply(protocol_version=PROTOCOL_VERSION, step=result.step, num_samples=samples)
        if targets:
            reply.loss = float(result.output.mean())
        if self.runtime.module.is_last:
            codec = get_codec("none")
        self.served += 1
        return pack_frames(reply, encode_tensor(result.output, codec))

    def fill_info(self, info: PeerInfo) -> None:
        """Adds the peer's inference figures to its info."""
        info.inference_seconds = self.work.busy_seconds
        info.inference_requests = self.served
        info.inference_sessions = len(self.sessions) if self.sessions is not None else 0
        delays = sorted(self.runtime.requests.inference_delays)
        if delays:
            info.inference_delay_p99 = delays[int(0.99 * (len(delays) - 1))]
            info.inference_delay_max = delays[-1]


def inference_handler(
    runtime: StageRuntime, limits: WireLimits, max_batch_samples: int, config: PeerConfig
) -> InferenceHandler:
    """A stage's inference side as `config` sets it: its chunked work and, unless it spills its blocks, its
    sessions' caches."""
    module = runtime.module
    sessions = None
    if runtime.spilling is None:
        memory = int(config.inference_memory_mb * 2**20)
        per_caller = config.inference_sessions_per_caller
        sessions = InferenceSessions(len(module.blocks), module.spec.seq_len, memory, per_caller)
    work = InferenceWork(runtime, config.inference_chunk_ms / 1000)
    return InferenceHandler(runtime, limits, max_batch_samples, work, sessions)


def uplink_turns(config: PeerConfig) -> UplinkTurns:
    """How the peer's replies share its uplink (`--uplink-turns`), across an emulated one for tests and benchmarks
    (`--emulate-uplink-mbit`)."""
    link = SharedLink(config.emulate_uplink_mbit) if config.emulate_uplink_mbit > 0 else None
    return UplinkTurns(config.uplink_turns, link)
