"""One stage call of the trainer, made good: retried on other peers of the stage when a peer fails or vanishes.

A failed attempt bans its peer a while and the router picks another; a call out of attempts waits
and goes round again while its stage still completes other calls. A backward refused as too stale
goes again at the stage's current step; a SHORT reply (the stage lost samples with a dead peer)
is met by sending again this trainer's lost backwards from the resend buffer. A reply that does
not hold what was asked counts as its peer's failure. Only a stage that completes no call for
--stage-wait-timeout, or a request refused alike by two peers, stops training.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from hivemind.p2p import PeerID

from swarm.compression import get_codec
from swarm.compression.link_choice import CodecChooser
from swarm.config import TrainerConfig
from swarm.models.registry import ModelSpec
from swarm.models.stage_io import StageOutputError, check_stage_outputs
from swarm.net.direct_plane import DirectPlane
from swarm.net.link_shaper import LinkShaper
from swarm.net.request_limits import reply_limits
from swarm.net.transport import CallStats, StageCallError, call_stage, nothing_listens
from swarm.policy.router import Router
from swarm.policy.service_timing import ServiceTimer
from swarm.proto import BACKWARD, FORWARD, ErrorCode, SampleId, StageReply, StageRequest
from swarm.records.stage_records import SERVING, StageRecord
from swarm.trainer.outcome import TrainingError, TrainingSummary
from swarm.trainer.peer_finder import PeerFinder
from swarm.trainer.resend_buffer import ResendBuffer
from swarm.trainer.spot_checks import SpotChecker
from swarm.trainer.trial_calls import TrialCalls
from swarm.trust.receipts import ReceiptSigner
from swarm.trust.vouchers import load_voucher

logger = logging.getLogger(__name__)

RESENT_MEMORY = 4096  # microbatches sent again whose taker is remembered (a few steps' worth)
REQUEUE_PAUSE_MAX = 8.0  # seconds: a re-queued call waits 2, 4, 8, 8... s, short of a stall worth the name
# seconds a call met by SHORT waits before asking again, unless this trainer has just sent again all the reply named:
# then the peer holds the call until its step (a fixed pause there cost each step with a lost mate that much)
SHORT_PAUSE = 0.3


class CallObserver(Protocol):
    """What watches the calls (the trainer's metrics, with --metrics-port)."""

    def call_failed(self, code: int) -> None:
        """One attempt of a call failed with ErrorCode `code`."""

    def call_answered(self, stage: int, backward: bool, codec: str, stats: CallStats, seconds: float) -> None:
        """One call was answered after `seconds`, network included."""


@dataclass
class _Attempts:
    """Where one call stands: its tries since it was last queued, and what they met."""

    step: int  # the model version asked for (a backward refused as too stale moves it to the stage's step)
    started_at: float  # monotonic
    attempts: int = 0
    requeues: int = 0
    tried: list[str] = field(default_factory=list)  # peers failed since the last queueing: not chosen again
    refused_by: dict[int, set[str]] = field(default_factory=dict)  # per error code that is no network accident
    short_since: float | None = None  # monotonic: when the stage first answered SHORT
    stepped_back: bool = False  # a peer behind the forward's step had the backward signed again for its step
    last_error: Exception | None = None


def receipt_signer(config: TrainerConfig) -> ReceiptSigner | None:
    """The trainer's receipt signer, from its --voucher (None without one: an open swarm)."""
    if config.voucher is None:
        return None
    voucher, key = load_voucher(Path(config.voucher))
    return ReceiptSigner(config.run_id, key, voucher)


class StageCaller:
    """The trainer's calls to the stages, through its router and transport; keeps what a resend needs."""

    def __init__(
        self,
        config: TrainerConfig,
        spec: ModelSpec,
        trainer_id: str,
        router: Router,
        peers: PeerFinder,
        summary: TrainingSummary,
        chooser: CodecChooser | None,
        shaper: LinkShaper | None,
    ) -> None:
        self.config = config
        self.spec = spec
        self.trainer_id = trainer_id  # the caller id peers see: half of every microbatch's id
        self.router = router
        self.peers = peers
        self.summary = summary  # counts retries, resends, bytes...
        self.chooser = chooser  # with --compression auto: a codec per peer, from what its link showed
        self.shaper = shaper  # with --emulate-bandwidth-mbit / --emulate-latency-ms
        self.p2p: DirectPlane | None = None  # set once the trainer's daemon is up, before the first call
        self.observer: CallObserver | None = None
        self.served_by = ""  # the peer that served the last call (read right after awaiting it)
        self.reached: dict[int, int] = {}  # per stage, the latest step this trainer's backwards were applied at
        self._last_success: dict[int, float] = {}  # per stage, when a call to it last succeeded (monotonic)
        self.timer = ServiceTimer()  # each reply's service seconds, apart from the network's (perf_counter)
        self._resend_buffer = ResendBuffer(int(config.resend_buffer_mb * 2**20))
        self._resending: set[tuple[int, int]] = set()  # (stage, microbatch) being sent again
        # (stage, microbatch) sent again lately: the step it was short at, and the peer that took it
        self._resent: OrderedDict[tuple[int, int], tuple[int, str]] = OrderedDict()
        # the dtype of the boundary tensors replies carry (`swarm.models.precision.expected_dtype`); None: float32
        # or bfloat16, whichever the peers compute in (the next stage's peer checks them against its own)
        self.dtype: torch.dtype | None = torch.float32
        self.receipts = receipt_signer(config)  # in a swarm with a trust root: signs each backward's receipt
        self.spot_checks: SpotChecker | None = None  # with a voucher and --spot-check-share: set by the trainer
        # peers on probation (never answered this trainer) are tried with copies of answered forwards
        self.trials = TrialCalls(router, self.attempt, self._codec_for)
        self._confirming: dict[str, asyncio.Task] = {}  # peers whose broken call is being checked (`_confirm_gone`)

    async def call(
        self,
        stage: int,
        backward: bool,
        tensors: list[torch.Tensor],
        microbatch_id: int,
        step: int,
        prefer: str | None = None,
    ) -> tuple[StageReply, list[torch.Tensor]]:
        """One stage call, retried on other peers of the stage when a peer fails or vanishes.

        `step` is the model version: for a forward the step the stage is asked for, for a
        backward the step its forward ran at (a backward refused as too stale goes again at the
        stage's current step). `prefer` names a peer to try first.
        """
        tries = _Attempts(step, started_at=time.monotonic())
        while True:
            if tries.attempts >= self.config.max_retries and not await self._requeue(stage, microbatch_id, tries):
                break
            samples = tensors[0].shape[0]
            preferred = [r for r in self.router.live_peers(stage) if r.peer_id == prefer and prefer not in tries.tried]
            record = preferred[0] if preferred else self.router.choose(stage, backward, samples, exclude=tries.tried)
            if record is None:
                await self.peers.wait_for_stage(stage, before_first_step=not self.summary.steps)
                continue
            tries.attempts += 1
            codec = self._codec_for(record.peer_id)
            stats = CallStats()
            started = time.perf_counter()
            try:
                reply, outputs = await self._send(
                    record, stage, backward, tensors, microbatch_id, tries.step, codec, stats
                )
            except StageCallError as e:
                await self._failed(record, stage, backward, microbatch_id, e, tries)
                continue
            network = stats.network_seconds
            service = self.timer.served(record.peer_id, started, time.perf_counter(), network)
            self.router.report_success(record.peer_id, backward, samples, service, network)
            self._answered(record, stage, backward, tensors, microbatch_id, reply, codec, stats, started)
            if not backward:
                self.trials.after_forward(stage, tensors, microbatch_id, tries.step)
            if self.spot_checks is not None:
                self.spot_checks.after_call(record, backward, tensors, microbatch_id, reply, outputs, get_codec(codec))
            return reply, outputs
        raise TrainingError(
            f"stage {stage} completed no call for {self.config.stage_wait_timeout:.0f}s; microbatch "
            f"{microbatch_id} failed {self.config.max_retries} attempts, {tries.requeues + 1} times over: "
            f"{tries.last_error}"
        )

    def _codec_for(self, peer_id: str) -> str:
        return self.chooser.codec_for(peer_id) if self.chooser else self.config.compression

    async def _requeue(self, stage: int, microbatch_id: int, tries: _Attempts) -> bool:
        """Out of attempts for now: said out loud, the call waits and goes round again; False to give up instead.

        Under churn that can happen many times while the stage still works for other calls, so the bound is
        the stage's progress: no call to it completed for stage_wait_timeout stops training with the error
        rather than drop the microbatch.
        """
        idle = time.monotonic() - max(self._last_success.get(stage, 0.0), tries.started_at)
        if idle > self.config.stage_wait_timeout:
            return False
        tries.requeues += 1
        self.summary.requeued += 1
        logger.warning(
            f"Stage {stage}: microbatch {microbatch_id} failed {tries.attempts} attempts ({tries.last_error}); "
            f"re-queued (time {tries.requeues}; the stage last completed a call {idle:.0f}s ago)"
        )
        await asyncio.sleep(min(REQUEUE_PAUSE_MAX, 2.0**tries.requeues))
        tries.attempts, tries.tried = 0, []
        return True

    async def _send(
        self,
        record: StageRecord,
        stage: int,
        backward: bool,
        tensors: list[torch.Tensor],
        microbatch_id: int,
        step: int,
        codec: str,
        stats: CallStats,
        check: bool = False,
    ) -> tuple[StageReply, list[torch.Tensor]]:
        """One attempt at `record`'s peer; a StageCallError if it fails or its reply does not hold what was asked.
        `check`: a spot check of a backward, which the peer answers without holding or counting anything."""
        request = StageRequest(
            kind=BACKWARD if backward else FORWARD,
            model=self.config.model,
            stage=stage,
            microbatch_id=microbatch_id,
            step=step,
            reply_codec=codec,
            check=check,
        )
        if backward and self.receipts is not None and not check:
            samples = tensors[0].shape[0]
            args = (self.trainer_id, record.peer_id, stage, microbatch_id, samples, step)
            request.receipt.CopyFrom(self.receipts.sign(*args))
            request.voucher.CopyFrom(self.receipts.voucher)
        reply, outputs = await call_stage(
            self.p2p,
            PeerID.from_base58(record.peer_id),
            request,
            tensors,
            get_codec(codec),
            self.router.deadline(record, backward, tensors[0].shape[0]),
            # a reply holds one boundary tensor of the call's samples: read within what that needs
            limits=reply_limits(self.spec.boundary_width, self.spec.seq_len, tensors[0].shape[0]),
            stats=stats,
            shaper=self.shaper,
        )
        self._check_reply(stage, backward, tensors, reply, outputs, record.peer_id)
        return reply, outputs

    attempt = _send  # one attempt at a peer, no retry: what a spot check or a trial asks of a second peer

    async def _failed(
        self, record: StageRecord, stage: int, backward: bool, microbatch_id: int, e: StageCallError, tries: _Attempts
    ) -> None:
        """Meets a failed attempt: the call goes again (at the stage's step, after a resend, or elsewhere with the
        peer banned), or TrainingError when the stage stayed short or the request itself is refused."""
        if self.observer is not None:
            self.observer.call_failed(e.code)
        if e.code == ErrorCode.STALE and e.reply is not None and backward and e.reply.step > tries.step:
            # the stage stepped twice since the forward: the gradient is applied at its current step
            # instead of running the microbatch again from the first stage (later stages have it)
            logger.info(f"Stage {stage}: microbatch {microbatch_id} too stale; sent at step {e.reply.step}")
            self.summary.stale_resent += 1
            tries.step = e.reply.step
            tries.attempts -= 1
            return
        if self._step_back(stage, backward, microbatch_id, e, tries):
            return
        if e.code == ErrorCode.SHORT and e.reply is not None:
            # not the peer's fault: the stage waits for lost samples; send ours and wait for its step
            settled = await self.resend_lost(stage, e.reply, record.peer_id)
            # at once only the first time: a peer that keeps answering SHORT is asked again at a pace
            settled = settled and tries.short_since is None
            tries.short_since = tries.short_since or time.monotonic()
            if time.monotonic() - tries.short_since > self.config.stage_wait_timeout:
                raise TrainingError(f"stage {stage} stayed short of lost samples: {e}") from e
            tries.attempts -= 1
            if not settled:  # others' samples (or ours, under way elsewhere) still missing: ask again in a while
                await asyncio.sleep(SHORT_PAUSE)
            return
        if not e.retriable:
            # one peer refusing is that peer's word (it may be broken or hostile): tried elsewhere.
            # Two peers (or the stage's only one) refusing alike says the request itself is wrong.
            refusers = tries.refused_by.setdefault(e.code, set())
            refusers.add(record.peer_id)
            serving = sum(r.state == SERVING for r in self.router.records.get(stage, {}).values())
            if len(refusers) >= min(2, max(1, serving)):
                raise TrainingError(f"stage {stage} refused a request: {e}") from e
        refused = nothing_listens(self.p2p, record.peer_id, e)
        ban = self.router.report_failure(record.peer_id, refused=refused, stage=stage)
        if e.retriable and not refused:
            self._confirm_gone(record.peer_id)
        tries.tried.append(record.peer_id)
        self.summary.retries += 1
        tries.last_error = e
        logger.warning(f"Stage {stage} call failed ({e}); peer banned for {ban:.0f}s, retrying")

    def _confirm_gone(self, peer_id: str) -> None:
        """A call broke without a refused dial (a peer killed mid-call resets its streams): if the direct address
        it answered at refuses connections now, it is gone, not slow. Checked in the background; without it, the
        ban's end drew another call into each dead peer in the p3 replays, and a step waited on its failure."""
        if self.p2p is None or peer_id in self._confirming:
            return

        async def confirm() -> None:
            try:
                if await self.p2p.confirm_refusal(peer_id):
                    self.router.mark_gone(peer_id)
            finally:
                self._confirming.pop(peer_id, None)

        self._confirming[peer_id] = asyncio.ensure_future(confirm())

    def _step_back(self, stage: int, backward: bool, microbatch_id: int, e: StageCallError, tries: _Attempts) -> bool:
        """A peer behind the step the backward's forward ran at (restored from a copy that lagged) counts a receipt
        only for its own step or the next: the backward goes again, signed for the peer's step. Once per call, so
        a peer answering ever lower steps costs one round trip, then counts as a failure."""
        if e.code != ErrorCode.OUT_OF_SYNC or e.reply is None or not backward or tries.stepped_back:
            return False
        if not 0 <= e.reply.step < tries.step:
            return False
        logger.info(f"Stage {stage}: a peer is behind step {tries.step}; microbatch {microbatch_id} sent at step "
                    f"{e.reply.step}")  # fmt: skip
        tries.step, tries.stepped_back = e.reply.step, True
        tries.attempts -= 1
        return True

    def _answered(
        self,
        record: StageRecord,
        stage: int,
        backward: bool,
        tensors: list[torch.Tensor],
        microbatch_id: int,
        reply: StageReply,
        codec: str,
        stats: CallStats,
        started: float,
    ) -> None:
        """Takes note of an answered call (`started` on the perf_counter clock)."""
        self._last_success[stage] = time.monotonic()
        if backward:  # kept (bounded) in case that peer dies before its stage steps
            self._resend_buffer.put((stage, microbatch_id), tensors)
            self.reached[stage] = max(self.reached.get(stage, reply.step), reply.step)
        self.summary.bytes_sent += stats.bytes_sent
        self.summary.bytes_received += stats.bytes_received
        if self.observer is not None:
            self.observer.call_answered(stage, backward, codec, stats, time.perf_counter() - started)
        if self.chooser is not None:
            self.chooser.observe(record.peer_id, stats.bytes_sent + stats.bytes_received, stats.network_seconds)
        self.served_by = record.peer_id

    def _check_reply(
        self, stage: int, backward: bool, inputs: list[torch.Tensor], reply: StageReply, outputs: list, peer_id: str
    ) -> None:
        """A reply that does not hold what was asked (tensor count, shapes, dtypes, values, loss) is the
        peer's failure: raised as a retriable error, so the call goes elsewhere and the peer is banned."""
        try:
            width = self.spec.boundary_width
            check_stage_outputs(stage, self.config.num_stages, width, backward, inputs, outputs, self.dtype)
            if backward and stage == self.config.num_stages - 1 and not math.isfinite(reply.loss):
                raise StageOutputError(f"backward of stage {stage} answered a loss of {reply.loss}")
        except StageOutputError as e:
            self.summary.bad_replies += 1
            raise StageCallError(ErrorCode.UNAVAILABLE, f"bad reply: {e}", peer_id) from None

    def _taken_again(self, key: tuple[int, int], short_step: int, to: str, live: set[str]) -> bool:
        """Whether microbatch `key` was sent again for `short_step` already, to a live peer other than `to`. A
        second SHORT naming it comes from a peer that has not heard of that copy (one the round left out, as a
        peer accused meanwhile): a second copy would be held by two peers and counted twice. Should the peer
        that took it die, it is no longer live, and the microbatch goes again."""
        again = self._resent.get(key)
        return again is not None and again[0] == short_step and again[1] != to and again[1] in live

    async def resend_listed(self, stage: int, record: StageRecord) -> None:
        """Sends again this trainer's microbatches that a short peer's record names as lost, unless sent again for
        that step already: a trainer whose calls wait at another stage never hears this one's SHORT reply, and
        the stage would wait out its --short-wait for them. Never raises: the SHORT replies remain the way back."""
        mine = [entry for entry in record.short if entry[0] == self.trainer_id]
        fresh = [(mb, n) for _, mb, n in mine if self._resent.get((stage, mb), (None,))[0] != record.short_step]
        if not fresh:
            return
        reply = StageReply(short_step=record.short_step)
        reply.lost.extend(SampleId(trainer=self.trainer_id, microbatch=mb, samples=n) for mb, n in fresh)
        try:
            await self.resend_lost(stage, reply, record.peer_id)
        except Exception as e:  # the stage's SHORT replies ask again; a stage that stays short is found there
            logger.info(f"Could not send again what stage {stage} lost of this trainer's: {e}")

    async def resend_lost(self, stage: int, reply: StageReply, to: str) -> bool:
        """Sends again this trainer's backwards that a SHORT reply names as lost with a dead peer of `stage`;
        returns whether that was all the reply named (the stage then has what it waits for, or soon will).

        They go to `to`, the peer that reported the loss, at the step it is short at. Those no longer in
        the resend buffer are counted; the stage steps without them after its --short-wait.
        """
        mine = [i for i in reply.lost if i.trainer == self.trainer_id]
        live = {r.peer_id for r in self.router.live_peers(stage)}
        settled = bool(mine) and len(mine) == len(reply.lost)
        for lost in mine:
            key = (stage, int(lost.microbatch))
            if key in self._resending or self._taken_again(key, reply.short_step, to, live):
                settled = False
                continue
            tensors = self._resend_buffer.get(key)
            if tensors is None:
                self.summary.lost_not_held += lost.samples
                self._resending.add(key)  # asked once is enough: it is not coming back
                settled = False
                continue
            self._resending.add(key)
            try:
                logger.warning(
                    f"Stage {stage} lost microbatch {key[1]} ({lost.samples} samples) of step {reply.short_step} "
                    "with a peer that died; sending it again"
                )
                await self.call(stage, True, tensors, key[1], reply.short_step, prefer=to)
                self._resent[key] = (reply.short_step, self.served_by)
                while len(self._resent) > RESENT_MEMORY:
                    self._resent.popitem(last=False)
                self.summary.samples_resent += lost.samples
            finally:
                self._resending.discard(key)
        return settled
