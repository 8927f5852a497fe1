"""The RPC handlers of a peer: read a stage call, check it, hand it to the runtime, answer.

Whatever a remote sends, the handler answers with a StageReply (an error reply for anything
wrong with the request) and never lets an exception out to take the peer down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

import torch

from swarm.compression import Codec, CodecError, get_codec
from swarm.models import GPTStage
from swarm.models.stage_io import StageInputError, check_stage_inputs, value_problem
from swarm.net.request_budget import RequestBudget
from swarm.net.request_limits import call_too_large, undecoded_problem
from swarm.net.uplink_turns import UplinkTurns
from swarm.net.wire import (
    INLINE_CODING_BYTES,
    Part,
    StreamEnded,
    WireError,
    WireLimits,
    codes_inline,
    decode_tensors,
    encode_tensor,
    pack_frames,
    read_frames,
)
from swarm.peer.faults import DropReply, FaultPlan
from swarm.peer.inference_handler import InferenceHandler
from swarm.peer.mate_messages import ids_to_wire
from swarm.peer.mates import StageMates
from swarm.peer.protocol_handler import send_reply
from swarm.peer.runtime import StageResult, StageRuntime, StaleGradientError
from swarm.proto import (
    BACKWARD,
    FORWARD,
    INFER,
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    PeerInfo,
    PeerInfoRequest,
    StageReply,
    StageRequest,
)
from swarm.records.stage_records import SERVING

logger = logging.getLogger(__name__)


class StageCallMetrics(Protocol):
    """What the handler tells the peer's metrics (`swarm.peer.metrics.PeerMetrics`) of the calls it serves."""

    def stage_request(self, parts: list[Part]) -> None:
        """A stage call's tensors were read."""

    def stage_served(self, backward: bool, samples: int, seconds: float, parts: list[Part]) -> None:
        """A stage call was answered with these tensor `parts`."""

    def stage_error(self, code: int) -> None:
        """A stage call was answered with the error `code`."""

    def info_error(self, code: int) -> None:
        """An info request was answered with the error `code`."""


def error_reply(code: int, message: str) -> StageReply:
    """A stage reply that carries only an error."""
    return StageReply(protocol_version=PROTOCOL_VERSION, error=Error(code=code, message=message))


class StageHandler:
    """Serves stage calls and info requests for one hosted stage."""

    def __init__(
        self,
        runtime: StageRuntime,
        model_name: str,
        limits: WireLimits,
        max_batch_samples: int,
        state: Callable[[], str],
        mates: StageMates,
        step_wait: float = 40.0,
        faults: FaultPlan | None = None,
        metrics: StageCallMetrics | None = None,
        budget: RequestBudget | None = None,
        inference: InferenceHandler | None = None,
        uplink: UplinkTurns | None = None,
    ) -> None:
        self.runtime = runtime
        self.inference = inference  # INFER calls (None: refused)
        self.uplink = uplink or UplinkTurns()  # replies to one caller leave one at a time
        self.stage: GPTStage = runtime.module
        self.model_name = model_name
        self.limits = limits
        self.max_batch_samples = max_batch_samples
        self.state = state
        self.mates = mates
        self.step_wait = step_wait
        self.faults = faults or FaultPlan()
        self.metrics = metrics  # None unless --metrics-port
        # bytes of requests held at once over every caller (--request-memory-mb); by default two of the largest
        self.budget = budget or RequestBudget(0, limits.max_message_bytes)
        self.requests_served = 0
        self.requests_refused = 0
        self._step_changed = asyncio.Event()

    def notify_step(self) -> None:
        """Wakes requests waiting on the stage's step machine; call on the event loop."""
        self._step_changed.set()
        self._step_changed = asyncio.Event()

    async def _wait_for_step(self, step: int) -> bool | None:
        """Waits until the stage may serve a forward that asks for `step` (at most `step_wait` seconds).

        A stage behind `step` that is still accumulating serves at once: with several trainers, the
        step a trainer asks for may need other trainers' samples. One that has its batch waits for
        its step, so a lone trainer sees exactly the parameters one process would. Returns whether
        it may serve; None while the step is short of samples lost with a mate (see `StageMates.lost`).
        A peer that stops serving (leaving, moving) answers its waiting calls at once: its step will not come.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.step_wait
        while self.runtime.step < step and self.mates.is_full():
            if self.state() != SERVING:
                return False
            if self.mates.lost():
                return None
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._step_changed.wait(), remaining)
        return True

    async def handle_stage(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Entry point of one stage call stream (registered with the P2P daemon)."""
        try:
            with self.budget.ticket() as ticket:
                frames = await self._serve(reader, str(stream_info.peer_id), ticket.take)
        except DropReply:
            with contextlib.suppress(Exception):
                writer.close()
            return
        except StreamEnded as e:
            # a cancelled call (a trainer stopping, a step given up): answered in case the caller still
            # listens, counted with the abandoned calls rather than as a refusal
            self.runtime.count_hung_up()
            logger.debug(f"A stage call from {stream_info.peer_id} ended mid-request")
            frames = [error_reply(e.code, str(e))]
        except WireError as e:
            frames = [self._error(e.code, str(e))]
        except asyncio.TimeoutError:
            frames = [self._error(ErrorCode.BAD_REQUEST, "request stalled: no data within the frame timeout")]
        except Exception as e:
            logger.exception("Failed to serve a stage call")
            frames = [self._error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")]
        # a caller gone away before the reply is worth a warning: it had work under way
        await send_reply(reader, writer, frames, str(stream_info.peer_id), logging.WARNING, self.uplink)

    async def _serve(
        self, reader: asyncio.StreamReader, caller: str, reserve: Callable[[int], None]
    ) -> list[StageReply]:
        request, parts = await read_frames(reader, StageRequest, self.limits, reserve)
        started = time.perf_counter()
        if self.metrics is not None:
            self.metrics.stage_request(parts)
        # the caller's clock started earlier (the request was on the wire): this errs on computing
        give_up_at = time.monotonic() + request.deadline_s if request.deadline_s > 0 else None
        if (refusal := self._refusal(request)) is not None:
            return [refusal]
        if request.kind == INFER:
            return await self.inference.serve(request, parts, caller, give_up_at, self._error)
        loop = asyncio.get_running_loop()
        backward = request.kind == BACKWARD
        check = backward and request.check  # a spot check: input gradients only, nothing held or counted
        receipts = self.mates.machine.receipts if not check else None
        dtype = self.runtime.dtype
        # before the tensors cost a decode: a backward counts only with a vouched trainer's receipt for this call
        if backward and receipts is not None and (refusal := self._receipt_refusal(request, caller)) is not None:
            return [refusal]

        def take() -> tuple[list[torch.Tensor], tuple[int, str] | None]:
            """The request's tensors, decoded and checked (a WireError if malformed), and what is wrong, if any."""
            # shapes and sizes as the headers announce them first: nothing is decoded beyond the model's shapes
            if (problem := undecoded_problem(self.stage, backward, parts, self.max_batch_samples, dtype)) is not None:
                return [], problem
            tensors = decode_tensors(parts, self.limits)
            if tensors and tensors[0].ndim and (samples := tensors[0].shape[0]) > self.max_batch_samples:
                return tensors, (ErrorCode.TOO_LARGE, call_too_large(samples, self.max_batch_samples))
            if receipts is not None and backward and tensors and tensors[0].ndim and samples != request.receipt.samples:
                return tensors, (ErrorCode.FORBIDDEN, "the receipt names another sample count than the call carries")
            try:
                check_stage_inputs(self.stage, backward, tensors, self.max_batch_samples, self.runtime.dtype)
            except StageInputError as e:
                return tensors, (ErrorCode.BAD_REQUEST, str(e))
            return tensors, None

        # decoded and checked in one go: on the loop where that costs less than a hand-off, else in a worker
        received = sum(len(part.buffer) for part in parts)
        inline = codes_inline([part.head.codec for part in parts], received)
        tensors, problem = take() if inline else await loop.run_in_executor(None, take)
        if problem is not None:
            return [self._error(*problem)]
        # answer in the codec the caller asked for, else in that of its first tensor
        try:
            codec = get_codec(request.reply_codec or parts[0].head.codec or "none")
        except CodecError as e:
            return [self._error(ErrorCode.BAD_REQUEST, f"reply codec: {e}")]
        # the caller expects the stage at request.step: its previous step must be applied first
        reached = await self._wait_for_step(request.step)
        if reached is None:
            return [self._short_reply()]
        if not reached:
            leaving = f" and {self.state()}" if self.state() != SERVING else ""
            return [
                self._error(
                    ErrorCode.UNAVAILABLE,
                    f"this peer is at step {self.runtime.step}, behind the requested step {request.step}{leaving}",
                )
            ]
        try:
            key = (caller, request.microbatch_id) if request.microbatch_id and not check else None
            # the last stage recomputes its forward from the targets: its gradient is never stale
            version = request.step if backward and not self.stage.is_last and not check else None
            if backward and receipts is not None and key is not None:
                receipts.keep(key, request)  # before the samples are held: a round may take them at once
            submitted = self.runtime.submit(backward, tensors, key, version, give_up_at, accumulate=not check)
            result = await asyncio.wrap_future(submitted)
        except StaleGradientError as e:
            reply = self._error(ErrorCode.STALE, str(e))
            reply.step = self.runtime.step  # the caller sends it again at this step
            return [reply]
        except RuntimeError as e:
            return [self._error(ErrorCode.UNAVAILABLE, str(e))]
        if backward and not check:
            # the mates hear of these samples before the caller does (see StageMates.progress_delivered)
            await self.mates.progress_delivered()
            await self.faults.hit("after_backward")
        return await self._answer(result, backward, tensors[0].shape[0], codec, started)

    def _receipt_refusal(self, request: StageRequest, caller: str) -> StageReply | None:
        """The error reply for a backward whose receipt is not good for this call, or that no round of this peer
        would count (its step set: the caller signs it again for this peer's step); None if it is served."""
        receipts = self.mates.machine.receipts
        if (problem := receipts.check_backward(request, caller, request.receipt.samples)) is not None:
            receipts.refused_backwards += 1
            return self._error(ErrorCode.FORBIDDEN, problem)
        if (outside := receipts.outside_rounds(request, self.runtime.step)) is not None:
            reply = self._error(*outside)
            reply.step = self.runtime.step
            return reply
        return None

    def _refusal(self, request: StageRequest) -> StageReply | None:
        """The error reply for a call this peer does not serve (another protocol, stage or kind; not serving)."""
        if request.protocol_version != PROTOCOL_VERSION:
            return self._error(
                ErrorCode.VERSION_MISMATCH,
                f"caller speaks protocol {request.protocol_version}, this peer speaks {PROTOCOL_VERSION}; "
                "upgrade swarm on the older side",
            )
        if request.model != self.model_name or request.stage != self.stage.stage:
            return self._error(
                ErrorCode.WRONG_STAGE,
                f"this peer hosts stage {self.stage.stage} of {self.model_name}, "
                f"not stage {request.stage} of {request.model or '(no model)'}",
            )
        if request.kind not in (FORWARD, BACKWARD, INFER):
            return self._error(ErrorCode.BAD_REQUEST, f"unknown call kind {request.kind}")
        if request.kind == INFER and self.inference is None:
            return self._error(ErrorCode.BAD_REQUEST, "this peer serves no inference")
        if self.state() != SERVING:
            return self._error(ErrorCode.UNAVAILABLE, f"this peer is {self.state()}, not serving")
        return None

    def _short_reply(self) -> StageReply:
        """SHORT: the step lost samples with a mate, named so that their trainers send them again."""
        short_step = self.runtime.step
        lost = self.mates.lost()
        reply = self._error(
            ErrorCode.SHORT,
            f"step {short_step} lost {sum(lost.values())} samples ({len(lost)} microbatches) with a mate; "
            "their trainers should send them again",
        )
        reply.short_step = short_step
        reply.lost.extend(ids_to_wire(lost))
        return reply

    async def _answer(
        self, result: StageResult, backward: bool, samples: int, codec: Codec, started: float
    ) -> list[StageReply]:
        """The reply to a served call: its outputs (or input gradients) in `codec`, never non-finite ones."""
        tensors, losses, finite = await self._landed(result, codec)
        if not finite:
            # its parameters went bad: never pass NaN on as an answer (the caller goes elsewhere)
            return [self._error(ErrorCode.INTERNAL, "this peer computed non-finite values; its state is broken")]

        async def poison() -> None:  # a peer gone bad past its own checks: its callers must catch it
            nonlocal tensors
            tensors = [torch.full_like(t, float("nan")) for t in tensors]

        await self.faults.hit("reply", act=poison)
        reply = StageReply(protocol_version=PROTOCOL_VERSION, step=result.step, num_samples=samples)
        if losses is not None:
            reply.loss = float(losses.mean())

        def encode() -> list[Part]:
            return [p for t in tensors for p in encode_tensor(t, codec)]

        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        inline = codes_inline([codec.name], nbytes) and not any(t.is_cuda for t in tensors)
        out_parts = encode() if inline else await asyncio.get_running_loop().run_in_executor(None, encode)
        self.requests_served += 1
        reply.server_seconds = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.stage_served(backward, reply.num_samples, reply.server_seconds, out_parts)
        return pack_frames(reply, out_parts)

    async def _landed(self, result: StageResult, codec: Codec) -> tuple[list[torch.Tensor], torch.Tensor | None, bool]:
        """A result's tensors and losses where the reply is made of them, and whether every value is finite.

        On a GPU they are copied to the host off the event loop while the runtime runs the next batch, or, in a
        lossy codec, left on the device (once ready) to be encoded there, so fewer bytes cross to the host. On a
        CPU they are there already; small ones are checked on the loop, where a hand-off would cost more."""
        copies = self.runtime.copies
        on_device = any(t.is_cuda for t in result.tensors) or (result.losses is not None and result.losses.is_cuda)

        def land() -> tuple[list[torch.Tensor], torch.Tensor | None, bool]:
            tensors, losses = result.tensors, result.losses
            if on_device and codec.lossy:
                copies.wait(result.ready)
                losses = None if losses is None else losses.cpu()
            elif on_device:
                extra = [] if losses is None else [losses]
                moved = copies.to_host([*tensors, *extra], result.ready)
                tensors, losses = moved[: len(tensors)], (moved[-1] if extra else None)
            return tensors, losses, not any(value_problem(t, math.inf) for t in tensors)

        nbytes = sum(t.numel() * t.element_size() for t in result.tensors)
        if not on_device and nbytes <= INLINE_CODING_BYTES:
            return land()
        return await asyncio.get_running_loop().run_in_executor(None, land)

    def _error(self, code: int, message: str) -> StageReply:
        self.requests_refused += 1
        if self.metrics is not None:
            self.metrics.stage_error(code)
        logger.info(f"Refused a stage call: {ErrorCode.Name(code)}: {message}")
        return error_reply(code, message)

    async def handle_info(self, _stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Entry point of an info request stream."""
        try:
            request, _ = await read_frames(reader, PeerInfoRequest, self.limits)
            info = self.info()
            if request.protocol_version != PROTOCOL_VERSION:
                info.error.code = ErrorCode.VERSION_MISMATCH
                info.error.message = f"caller speaks protocol {request.protocol_version}, peer {PROTOCOL_VERSION}"
        except WireError as e:
            info = PeerInfo(protocol_version=PROTOCOL_VERSION, error=Error(code=e.code, message=str(e)))
        except Exception as e:
            info = PeerInfo(protocol_version=PROTOCOL_VERSION, error=Error(code=ErrorCode.INTERNAL, message=str(e)))
        if info.error.code != ErrorCode.OK and self.metrics is not None:
            self.metrics.info_error(info.error.code)
        await send_reply(reader, writer, [info], "an info request")

    def info(self) -> PeerInfo:
        step, fingerprint = self.runtime.version  # changed together: a step is never paired with another's hash
        info = PeerInfo(
            protocol_version=PROTOCOL_VERSION,
            model=self.model_name,
            stage=self.stage.stage,
            num_stages=self.stage.num_stages,
            step=step,
            throughput=self.runtime.throughput,
            queue_length=self.runtime.queue_length,
            state=self.state(),
            samples_accumulated=self.runtime.samples_accumulated,
            target_batch_size=self.runtime.target_batch_size,
            stale_gradients=self.runtime.stale_gradients,
            requests_served=self.requests_served,
            resyncs=self.mates.resyncs,
            samples_stepped=self.runtime.samples_stepped,
            abandoned_calls=self.runtime.abandoned,
            fingerprint=fingerprint,
            samples_lost=self.mates.samples_lost,
            samples_doubled=self.mates.samples_doubled,
            duplicate_backwards=self.runtime.duplicates,
            divergences=self.mates.divergences,
            step_state=self.mates.phase(),
            refused_outsiders=self.mates.refused_outsiders,
            unconfirmed_states=self.mates.unconfirmed_states,
            busy_seconds=self.runtime.busy_seconds,
        )
        if self.inference is not None:
            self.inference.fill_info(info)
        if (receipts := self.mates.machine.receipts) is not None:  # what lets a newcomer take this peer's state
            shown, vouchers = receipts.latest_own()
            info.receipts.extend(shown)
            info.vouchers.extend(vouchers)
        return info
