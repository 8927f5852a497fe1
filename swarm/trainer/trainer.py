"""The trainer: reads data and drives microbatches through the stages; holds no parameters.

For each optimizer step it draws the global batch, cuts it into microbatches and keeps several in
flight, so that every stage works at once. A microbatch goes forward through stages 0..N-2, then
the last stage computes the loss and its input gradient in one call, then gradients flow back
through stages N-2..0. The trainer keeps each stage's input until that stage's backward is done,
so every call can be retried on another peer of the stage (peers keep no activations).

Every microbatch has a global id (this trainer's peer id, a microbatch number). A stage whose
peer died holding applied backwards names the lost ids in its SHORT reply; the trainer sends
again those it still holds in a bounded buffer (`--resend-buffer-mb`). Nothing depends on that
buffer surviving: a stage waits for lost samples only a bounded time, then steps without them.
After its last step a trainer waits (bounded) until every stage has stepped past it, so that what
a stage lost of its last microbatches is sent again too. Several trainers may feed one swarm; each
asks a stage for the step after the one its own last backwards reached, and a stage still short
of its batch serves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from tqdm import tqdm

from swarm.compression import CODECS, get_codec
from swarm.compression.link_choice import CodecChooser, activation_like, profile_codecs
from swarm.config import TrainerConfig
from swarm.models.stage_io import StageOutputError, check_stage_outputs
from swarm.net.dht_node import connect_to_daemon, start_dht
from swarm.net.direct_plane import DirectPlane
from swarm.net.link_shaper import LinkShape, LinkShaper
from swarm.net.transport import CallStats, StageCallError, call_stage
from swarm.policy.in_flight import InFlightGate, InFlightWindow
from swarm.policy.router import Router
from swarm.process.event_loop import run, stop_event_on_signals
from swarm.process.launch_clock import seconds_since_launch
from swarm.proto import BACKWARD, FORWARD, ErrorCode, StageRequest
from swarm.records.sample_ledger import SampleLedger, fed_record
from swarm.records.stage_records import SERVING, StageRecord, fetch_stage_records
from swarm.records.trainer_records import TrainerProgress, direct_addresses, publish_forever, publish_now
from swarm.trainer.data import Corpus, CorpusError, load_corpus

if TYPE_CHECKING:
    from swarm.trainer.metrics import TrainerMetrics

logger = logging.getLogger(__name__)

REFRESH_PERIOD = 2.0
REQUEUE_PAUSE_MAX = 8.0  # seconds: a re-queued call waits 2, 4, 8, 8... s, short of a stall worth the name


class TrainingError(RuntimeError):
    """Training cannot go on: a stage stayed empty too long, or a call failed past its retries."""


@dataclass
class TrainingSummary:
    """What a training run did, as printed at the end and written to --summary-file."""

    steps: int = 0
    first_step: int = 0
    samples: int = 0
    seconds: float = 0.0
    samples_per_second: float = 0.0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    retries: int = 0
    samples_resent: int = 0  # backwards sent again because the peer that applied them died before its step
    lost_not_held: int = 0  # samples a stage asked for again that the resend buffer no longer held
    stale_resent: int = 0  # backwards refused as too stale, sent again at the stage's current step
    requeued: int = 0  # calls that ran out of attempts and were queued again after a pause
    backwards_moved: int = 0  # backwards served by another peer than their forward (its peer gone or busy)
    bans: int = 0
    bad_replies: int = 0  # replies refused for what they held (count, shape, dtype, values): sent elsewhere
    step_seconds: list[float] = field(default_factory=list)  # since the start, at the end of each step
    bytes_sent: int = 0
    bytes_received: int = 0
    codecs: dict[str, str] = field(default_factory=dict)  # per peer, at the end (with --compression auto)
    # stage calls opened per path: direct (TCP), libp2p, and direct tries that failed (then made over libp2p)
    calls_by_path: dict[str, int] = field(default_factory=dict)
    # start-up, in seconds after the process was launched: every stage found, and the first step done
    found_swarm_after_launch_s: float = float("nan")
    first_step_after_launch_s: float = float("nan")
    losses: list[float] = field(default_factory=list)
    # with --in-flight-from-links: the window's size at the end, its largest, its size at the end of each
    # step, and the smallest round trip of a microbatch it measured (seconds)
    in_flight_window: int = 0
    in_flight_window_largest: int = 0
    in_flight_window_per_step: list[int] = field(default_factory=list)
    in_flight_round_trip_s: float = float("nan")
    # after the last step: seconds until every stage stepped past it, and whether every stage did (a stage that
    # waits for other trainers' samples to fill its step does not)
    settle_seconds: float = 0.0
    settled: bool = False


class ResendBuffer:
    """The inputs of applied backwards, by (stage, microbatch), oldest dropped first past a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[tuple[int, int], tuple[list[torch.Tensor], int]] = OrderedDict()

    def put(self, key: tuple[int, int], tensors: list[torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > self.max_bytes:
            return
        if key in self._items:
            self.bytes -= self._items.pop(key)[1]
        self._items[key] = (tensors, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self.bytes -= self._items.popitem(last=False)[1][1]

    def get(self, key: tuple[int, int]) -> list[torch.Tensor] | None:
        item = self._items.get(key)
        return None if item is None else item[0]

    def __len__(self) -> int:
        return len(self._items)


class Trainer:
    """Drives training through the swarm found in the DHT."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.spec = config.model_spec()
        self.chooser: CodecChooser | None = None
        if config.compression == "auto":
            width = self.spec.boundary_width
            sample = activation_like((config.microbatch_size, self.spec.seq_len, width))
            self.chooser = CodecChooser(profile_codecs(CODECS.values(), sample), config.max_codec_error)
        self.shaper = None
        if config.emulate_bandwidth_mbit or config.emulate_latency_ms:
            self.shaper = LinkShaper(LinkShape(config.emulate_bandwidth_mbit, config.emulate_latency_ms))
        self.router = Router(deadline_floor=config.call_timeout_floor, deadline_ceiling=config.call_timeout)
        self.summary = TrainingSummary()
        # the DHT forks: create it before the corpus or anything else starts threads
        self.dht = start_dht(config)
        try:
            self.corpus = self._load_corpus()
        except TrainingError:
            self.dht.shutdown()
            raise
        self.p2p: DirectPlane | None = None
        self.step = 0
        self.trainer_id = str(self.dht.peer_id)  # the caller id peers see: half of every microbatch's id
        self.ledger = SampleLedger(config.ledger)
        # random start: a restarted trainer with the same identity must not reuse microbatch ids
        self._microbatch_ids = random.getrandbits(62)
        self.in_flight_window: InFlightWindow | None = None  # with --in-flight-from-links
        # per stage, the step to ask a forward for: the one after the step its latest backwards reached
        self._want: dict[int, int] = {}
        self._reached: dict[int, int] = {}
        self._resend_buffer = ResendBuffer(int(config.resend_buffer_mb * 2**20))
        self._resending: set[tuple[int, int]] = set()  # (stage, microbatch) being sent again
        self._served_by = ""  # the peer that served the last call (read right after awaiting it)
        self._last_success: dict[int, float] = {}  # per stage, when a call to it last succeeded (monotonic)
        self.metrics: TrainerMetrics | None = None  # with --metrics-port
        self.progress = TrainerProgress(self.trainer_id, config.model, config.num_stages)  # for `swarm monitor`
        self._wrong_vocab: dict[str, tuple[int, int]] = {}  # peers whose model has another vocabulary: stage, size

    def _load_corpus(self) -> Corpus:
        """The corpus of --data (and --tokenizer); TrainingError if it cannot be used or the model cannot hold it."""
        config = self.config
        try:
            corpus = load_corpus(
                config.data, int(config.max_corpus_mb * 2**20), config.tokenizer, config.data_split, config.text_column
            )
        except CorpusError as e:
            raise TrainingError(str(e)) from None
        if corpus.vocab_size > self.spec.vocab_size:
            raise TrainingError(
                f"the data {corpus.name} has token ids up to {corpus.vocab_size - 1}, but the model knows "
                f"{self.spec.vocab_size}: start this trainer and every peer with --vocab-size {corpus.vocab_size}"
            )
        return corpus

    # --- peers -----------------------------------------------------------------------------------

    async def refresh_peers(self) -> dict[int, list[StageRecord]]:
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(
            None, fetch_stage_records, self.dht, self.config.run_id, self.config.num_stages
        )
        mine = {
            stage: [r for r in recs if r.model == self.config.model and r.num_stages == self.config.num_stages]
            for stage, recs in records.items()
        }
        for stage, recs in mine.items():
            # a peer whose embedding or head has another size cannot serve this trainer's token ids
            for r in recs:
                if r.vocab_size not in (0, self.spec.vocab_size) and r.peer_id not in self._wrong_vocab:
                    self._wrong_vocab[r.peer_id] = (stage, r.vocab_size)
                    logger.warning(
                        f"Ignoring peer {r.peer_id} of stage {stage}: its model knows {r.vocab_size} token ids, "
                        f"this trainer's {self.spec.vocab_size}; start it with --vocab-size {self.spec.vocab_size}"
                    )
            mine[stage] = [r for r in recs if r.vocab_size in (0, self.spec.vocab_size)]
        self.router.update(mine, get_dht_time())
        if self.p2p is not None:
            self.p2p.learn(r for recs in mine.values() for r in recs)
        return mine

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_PERIOD)
            try:
                await self.refresh_peers()
            except Exception as e:
                logger.warning(f"Could not read peers from the DHT: {e}")

    async def wait_for_stage(self, stage: int) -> None:
        """Waits until `stage` has a live peer, saying so; TrainingError after stage_wait_timeout."""
        deadline = time.monotonic() + self.config.stage_wait_timeout
        warned = False
        while not self.router.live_peers(stage):
            wrong = sorted({size for s, size in self._wrong_vocab.values() if s == stage})
            if wrong and not self.summary.steps:
                raise TrainingError(
                    f"stage {stage} has only peers whose model knows {', '.join(map(str, wrong))} token ids, this "
                    f"trainer's {self.spec.vocab_size}: start the peers and this trainer with the same --vocab-size"
                )
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"stage {stage} has had no live peer for {self.config.stage_wait_timeout:.0f}s; "
                    f"start one with `swarm peer --stage {stage} --initial-peers ...`"
                )
            if not warned:
                logger.warning(f"Stage {stage} has no live peer yet; waiting for one to join")
                warned = True
            await asyncio.sleep(0.5)
            await self.refresh_peers()
        if warned:
            logger.info(f"Stage {stage} has a live peer again; resuming")

    async def wait_for_swarm(self) -> tuple[int, int]:
        """Waits for every stage to have a peer; returns (target batch size, current step)."""
        await self.refresh_peers()
        for stage in range(self.config.num_stages):
            await self.wait_for_stage(stage)
        peers = [r for stage in range(self.config.num_stages) for r in self.router.live_peers(stage)]
        targets = {r.target_batch_size for r in peers}
        if len(targets) != 1:
            raise TrainingError(f"peers disagree on --target-batch-size: {sorted(targets)}; restart them alike")
        steps = {r.step for r in peers}
        if len(steps) > 1:
            logger.warning(f"Stages are at different steps {sorted(steps)}; continuing from the lowest")
        return targets.pop(), min(steps)

    # --- calls -----------------------------------------------------------------------------------

    async def call(
        self,
        stage: int,
        backward: bool,
        tensors: list[torch.Tensor],
        microbatch_id: int,
        step: int,
        prefer: str | None = None,
    ):
        """One stage call, retried on other peers of the stage when a peer fails or vanishes.

        `step` is the model version: for a forward the step the stage is asked for, for a
        backward the step its forward ran at (a backward refused as too stale goes again at the
        stage's current step).
        """
        tried: list[str] = []
        refused_by: dict[int, set[str]] = {}  # per error code that is no network accident, the peers that sent it
        last_error: Exception | None = None
        attempts, short_since, requeues = 0, None, 0
        started_at = time.monotonic()
        while True:
            if attempts >= self.config.max_retries:
                # out of attempts for now: said out loud, the call waits and goes round again. Under churn
                # that can happen many times while the stage still works for other calls, so the bound is
                # the stage's progress: no call to it completed for stage_wait_timeout stops training with
                # the error rather than drop the microbatch.
                idle = time.monotonic() - max(self._last_success.get(stage, 0.0), started_at)
                if idle > self.config.stage_wait_timeout:
                    break
                requeues += 1
                self.summary.requeued += 1
                logger.warning(
                    f"Stage {stage}: microbatch {microbatch_id} failed {attempts} attempts ({last_error}); "
                    f"re-queued (time {requeues}; the stage last completed a call {idle:.0f}s ago)"
                )
                await asyncio.sleep(min(REQUEUE_PAUSE_MAX, 2.0**requeues))
                attempts, tried = 0, []
            samples = tensors[0].shape[0]
            preferred = [r for r in self.router.live_peers(stage) if r.peer_id == prefer and prefer not in tried]
            record = preferred[0] if preferred else self.router.choose(stage, backward, samples, exclude=tried)
            if record is None:
                await self.wait_for_stage(stage)
                continue
            attempts += 1
            codec = self.chooser.codec_for(record.peer_id) if self.chooser else self.config.compression
            request = StageRequest(
                kind=BACKWARD if backward else FORWARD,
                model=self.config.model,
                stage=stage,
                microbatch_id=microbatch_id,
                step=step,
                reply_codec=codec,
            )
            stats = CallStats()
            started = time.perf_counter()
            try:
                reply, outputs = await call_stage(
                    self.p2p,
                    PeerID.from_base58(record.peer_id),
                    request,
                    tensors,
                    get_codec(codec),
                    self.router.deadline(record, backward, samples),
                    stats=stats,
                    shaper=self.shaper,
                )
                self._check_reply(stage, backward, tensors, reply, outputs, record.peer_id)
            except StageCallError as e:
                if self.metrics is not None:
                    self.metrics.call_failed(e.code)
                if e.code == ErrorCode.STALE and e.reply is not None and backward and e.reply.step > step:
                    # the stage stepped twice since the forward: the gradient is applied at its current step
                    # instead of running the microbatch again from the first stage (later stages have it)
                    logger.info(f"Stage {stage}: microbatch {microbatch_id} too stale; sent at step {e.reply.step}")
                    self.summary.stale_resent += 1
                    step = e.reply.step
                    attempts -= 1
                    continue
                if e.code == ErrorCode.SHORT and e.reply is not None:
                    # not the peer's fault: the stage waits for lost samples; send ours and wait for its step
                    await self.resend_lost(stage, e.reply, record.peer_id)
                    short_since = short_since or time.monotonic()
                    if time.monotonic() - short_since > self.config.stage_wait_timeout:
                        raise TrainingError(f"stage {stage} stayed short of lost samples: {e}") from e
                    attempts -= 1
                    await asyncio.sleep(0.3)
                    continue
                if not e.retriable:
                    # one peer refusing is that peer's word (it may be broken or hostile): tried elsewhere.
                    # Two peers (or the stage's only one) refusing alike says the request itself is wrong.
                    refusers = refused_by.setdefault(e.code, set())
                    refusers.add(record.peer_id)
                    serving = sum(r.state == SERVING for r in self.router.records.get(stage, {}).values())
                    if len(refusers) >= min(2, max(1, serving)):
                        raise TrainingError(f"stage {stage} refused a request: {e}") from e
                ban = self.router.report_failure(record.peer_id)
                tried.append(record.peer_id)
                self.summary.retries += 1
                last_error = e
                logger.warning(f"Stage {stage} call failed ({e}); peer banned for {ban:.0f}s, retrying")
                continue
            self.router.report_success(record.peer_id, backward, samples, time.perf_counter() - started)
            self._last_success[stage] = time.monotonic()
            if backward:  # kept (bounded) in case that peer dies before its stage steps
                self._resend_buffer.put((stage, microbatch_id), tensors)
                self._reached[stage] = max(self._reached.get(stage, reply.step), reply.step)
            self.summary.bytes_sent += stats.bytes_sent
            self.summary.bytes_received += stats.bytes_received
            if self.metrics is not None:
                self.metrics.call_answered(stage, backward, codec, stats, time.perf_counter() - started)
            if self.chooser is not None:
                self.chooser.observe(record.peer_id, stats.bytes_sent + stats.bytes_received, stats.network_seconds)
            self._served_by = record.peer_id
            return reply, outputs
        raise TrainingError(
            f"stage {stage} completed no call for {self.config.stage_wait_timeout:.0f}s; microbatch "
            f"{microbatch_id} failed {self.config.max_retries} attempts, {requeues + 1} times over: {last_error}"
        )

    def _check_reply(
        self, stage: int, backward: bool, inputs: list[torch.Tensor], reply, outputs: list, peer_id: str
    ) -> None:
        """A reply that does not hold what was asked (tensor count, shapes, dtypes, values, loss) is the
        peer's failure: raised as a retriable error, so the call goes elsewhere and the peer is banned."""
        try:
            width = self.spec.boundary_width
            check_stage_outputs(stage, self.config.num_stages, width, backward, inputs, outputs)
            if backward and stage == self.config.num_stages - 1 and not math.isfinite(reply.loss):
                raise StageOutputError(f"backward of stage {stage} answered a loss of {reply.loss}")
        except StageOutputError as e:
            self.summary.bad_replies += 1
            raise StageCallError(ErrorCode.UNAVAILABLE, f"bad reply: {e}", peer_id) from None

    async def resend_lost(self, stage: int, reply, to: str) -> None:
        """Sends again this trainer's backwards that a SHORT reply names as lost with a dead peer of `stage`.

        They go to `to`, the peer that reported the loss, at the step it is short at. Those no longer in
        the resend buffer are counted; the stage steps without them after its --short-wait.
        """
        mine = [i for i in reply.lost if i.trainer == self.trainer_id]
        for lost in mine:
            key = (stage, int(lost.microbatch))
            if key in self._resending:
                continue
            tensors = self._resend_buffer.get(key)
            if tensors is None:
                self.summary.lost_not_held += lost.samples
                self._resending.add(key)  # asked once is enough: it is not coming back
                continue
            self._resending.add(key)
            try:
                logger.warning(
                    f"Stage {stage} lost microbatch {key[1]} ({lost.samples} samples) of step {reply.short_step} "
                    "with a peer that died; sending it again"
                )
                await self.call(stage, True, tensors, key[1], reply.short_step, prefer=to)
                self.summary.samples_resent += lost.samples
            finally:
                self._resending.discard(key)

    async def run_microbatch(self, tokens: torch.Tensor) -> float:
        """Forward and backward of one microbatch through every stage; returns its mean loss."""
        self._microbatch_ids += 1
        mb = self._microbatch_ids
        last = self.config.num_stages - 1
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        ids = [inputs] if self.spec.later_stages_take_tokens else []
        stage_inputs, versions, forward_peers = [[inputs]], [], []
        for stage in range(last):
            reply, (hidden,) = await self.call(stage, False, stage_inputs[-1], mb, self._want[stage])
            stage_inputs.append([hidden, *ids])
            versions.append(reply.step)
            forward_peers.append(self._served_by)
        reply, grads = await self.call(last, True, [*stage_inputs[last], targets], mb, self._want[last])
        for stage in reversed(range(last)):
            (grad,) = grads
            _, grads = await self.call(stage, True, [*stage_inputs[stage], grad], mb, versions[stage])
            if self._served_by != forward_peers[stage]:  # stateless serving: any stage-mate can do it
                self.summary.backwards_moved += 1
        self.ledger.write(fed_record(self.trainer_id, mb, len(tokens), at=time.time()))
        return reply.loss

    async def run_step(
        self, batch: torch.Tensor, gate: InFlightGate | None = None, admitted: asyncio.Event | None = None
    ) -> float:
        """One optimizer step's worth of microbatches; returns the mean loss over the batch.

        `gate` bounds the microbatches in flight (shared with an overlapping step's); `admitted` is set once
        every microbatch of this step has got past it, when the next step may start.
        """
        gate = gate or self._in_flight_gate()
        microbatches = batch.split(self.config.microbatch_size)
        waiting = len(microbatches)

        async def limited(tokens: torch.Tensor) -> tuple[float, int]:
            nonlocal waiting
            async with gate as sent:
                waiting -= 1
                if not waiting and admitted is not None:
                    admitted.set()
                loss = await self.run_microbatch(tokens)
                gate.completed(len(tokens), sent)
                return loss, len(tokens)

        results = await asyncio.gather(*(limited(mb) for mb in microbatches))
        # the next step's forwards ask each stage for the step after the one these backwards reached: a
        # stage that has its batch waits to get there, one still short of it serves at once
        for stage, reached in self._reached.items():
            self._want[stage] = max(self._want.get(stage, 0), reached + 1)
        return sum(loss * n for loss, n in results) / sum(n for _, n in results)

    def _probe(self, stage: int) -> list[torch.Tensor]:
        """The inputs of a one-token forward to `stage`: all it asks of the stage is to be at a step."""
        tokens = torch.zeros(1, 1, dtype=torch.int64)
        if stage == 0:
            return [tokens]
        hidden = torch.zeros(1, 1, self.spec.boundary_width)
        return [hidden, tokens] if self.spec.later_stages_take_tokens else [hidden]

    async def settle(self) -> bool:
        """After the last step: waits until every stage has stepped past the step this trainer's last
        backwards reached; returns whether every stage confirmed it.

        A stage that loses a dying peer's samples before its round asks their trainers for them in the
        SHORT reply to their next forward; after its last step a trainer sends none, so it asks each
        stage for the next step with a one-token forward instead, which waits for that step and meets
        any SHORT reply with the resends. A stage still short of other trainers' samples answers at
        once: what it holds of this trainer's is then in their step, not lost.
        """

        async def past(stage: int, step: int) -> bool:
            reply, _ = await self.call(stage, False, self._probe(stage), 0, step)
            if reply.step < step:
                logger.info(f"Stage {stage} is at step {reply.step}, waiting for other trainers' samples to step")
            return reply.step >= step

        try:
            return all(
                await asyncio.wait_for(
                    asyncio.gather(*(past(stage, reached + 1) for stage, reached in self._reached.items())),
                    self.config.stage_wait_timeout,
                )
            )
        except (asyncio.TimeoutError, TrainingError) as e:
            logger.warning(
                f"Could not see every stage step past this trainer's last step ({str(e) or 'timed out'}); what a "
                "stage lost of its last microbatches with a dying peer is counted lost by id there"
            )
            return False

    def _in_flight_gate(self) -> InFlightGate:
        """The bound on microbatches in flight: --max-in-flight, or a window sized from the pipeline (the
        trainer keeps one window for the whole run, so what it learned carries from step to step)."""
        if self.in_flight_window is None and self.config.in_flight_from_links:
            # from one microbatch per stage: the pipeline holds at least that much once it is full
            self.in_flight_window = InFlightWindow(
                initial=self.config.num_stages, maximum=self.config.max_in_flight,
                microbatch_samples=self.config.microbatch_size,
            )  # fmt: skip
        return InFlightGate(self.config.max_in_flight, self.in_flight_window)

    # --- the run ---------------------------------------------------------------------------------

    async def _steps(self, count: int, target_batch_size: int, stop: asyncio.Event) -> AsyncGenerator[float, None]:
        """Runs `count` steps from `self.step`, yielding each one's loss in order, until a stop is requested
        (a step waiting for peers can take long: it is then cancelled, and not counted).

        With --overlap-steps, the next step starts once every microbatch of the one before is in flight,
        sharing its bound on microbatches in flight: at most two steps are under way.
        """
        data_seed = self.config.seed if self.config.data_seed is None else self.config.data_seed
        depth = 2 if self.config.overlap_steps else 1
        gate = self._in_flight_gate()
        running: deque[tuple[asyncio.Task, asyncio.Event]] = deque()
        stopping = asyncio.create_task(stop.wait())
        started = 0
        try:
            while started < count or running:
                while running and running[0][0].done():
                    yield running.popleft()[0].result()
                if stop.is_set():
                    if running:
                        logger.info(f"Stopping on request; step {self.step} was not finished and is not counted")
                    else:
                        logger.info("Stopping early on request")
                    return
                while started < count and len(running) < depth and (not running or running[-1][1].is_set()):
                    batch = self.corpus.batch(self.step + len(running), target_batch_size, self.spec.seq_len, data_seed)
                    admitted = asyncio.Event()
                    running.append((asyncio.create_task(self.run_step(batch, gate, admitted)), admitted))
                    started += 1
                if not running:
                    return
                waits = [running[0][0], stopping]
                if started < count and len(running) < depth:  # the next step may start once this one is in
                    waits.append(asyncio.create_task(running[-1][1].wait()))
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for extra in waits[2:]:
                    extra.cancel()
        finally:
            stopping.cancel()
            for task, _ in running:
                task.cancel()
            for task, _ in running:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _start_metrics(self) -> None:
        """--metrics-port: serves the trainer's Prometheus metrics (ConfigError if the address cannot be bound)."""
        from swarm.trainer.metrics import TrainerMetrics, serve_metrics

        self.metrics = TrainerMetrics(self)
        serve_metrics(self.metrics.registry, self.config.metrics_host, self.config.metrics_port)

    async def train(self) -> TrainingSummary:
        config = self.config
        if config.metrics_port is not None:
            self._start_metrics()
        stop = stop_event_on_signals()
        self.p2p = DirectPlane(await connect_to_daemon(self.dht), self.dht.identity, dial=config.direct)
        self.progress.addresses = await direct_addresses(self.p2p)
        refreshing = asyncio.create_task(self._refresh_forever())
        publishing = asyncio.create_task(publish_forever(self.dht, config.run_id, self.progress))
        steps: AsyncGenerator[float, None] | None = None
        try:
            target_batch_size, self.step = await self.wait_for_swarm()
            self._want = {stage: self.step for stage in range(config.num_stages)}
            summary = self.summary
            summary.found_swarm_after_launch_s = round(seconds_since_launch(), 3)
            logger.info(
                f"Found all {config.num_stages} stages of {config.model} {summary.found_swarm_after_launch_s:.2f}s "
                f"after launch; training {config.steps} steps of {target_batch_size} samples from step {self.step}"
            )
            summary.first_step = self.step
            start = time.perf_counter()
            self.progress.begin()
            bar = tqdm(total=config.steps, desc="training", unit="step", disable=not config.progress, mininterval=1.0)
            steps = self._steps(config.steps, target_batch_size, stop)
            async for loss in steps:  # the generator is closed in `finally`, whatever happens here
                self.step += 1
                summary.steps += 1
                if summary.steps == 1:
                    summary.first_step_after_launch_s = round(seconds_since_launch(), 3)
                summary.samples += target_batch_size
                summary.losses.append(loss)
                if self.metrics is not None:
                    self.metrics.step_finished(target_batch_size, loss)
                summary.seconds = time.perf_counter() - start
                summary.samples_per_second = summary.samples / summary.seconds
                summary.step_seconds.append(round(summary.seconds, 3))
                if self.in_flight_window is not None:
                    summary.in_flight_window_per_step.append(self.in_flight_window.size)
                summary.bans = self.router.bans_issued
                banned = [p for p, ban in self.router.bans.items() if ban.until > self.router.clock()]
                self.progress.add_step(self.step, loss, target_batch_size, summary.bans, banned)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", samples_s=f"{summary.samples_per_second:.1f}")
                if not config.progress and summary.steps % 10 == 0:
                    logger.info(f"step {self.step} loss {loss:.4f} {summary.samples_per_second:.1f} samples/s")
            bar.close()
            if not stop.is_set():
                settling = time.perf_counter()
                stopping = asyncio.create_task(stop.wait())
                settle = asyncio.create_task(self.settle())
                await asyncio.wait([settle, stopping], return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if settle.done():
                    summary.settled = settle.result()
                else:
                    settle.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await settle
                summary.settle_seconds = round(time.perf_counter() - settling, 3)
        finally:
            if steps is not None:
                await steps.aclose()
            refreshing.cancel()
            publishing.cancel()
        # the steps since the last periodic record: a monitor shows where this trainer ended, not a step before
        if not await publish_now(self.dht, config.run_id, self.progress):
            logger.warning("Could not publish this trainer's final progress; monitors show its last record before")
        if self.chooser is not None:
            summary.codecs = self.chooser.choices()
        summary.calls_by_path = dict(self.p2p.calls)
        if self.in_flight_window is not None:
            window = self.in_flight_window
            summary.in_flight_window, summary.in_flight_window_largest = window.size, window.largest
            summary.in_flight_round_trip_s = round(window.round_trip, 3)
        if summary.losses:
            summary.first_loss = summary.losses[0]
            tail = summary.losses[-min(5, len(summary.losses)) :]
            summary.last_loss = sum(tail) / len(tail)
        return summary

    def shutdown(self) -> None:
        self.dht.shutdown()


def run_trainer(config: TrainerConfig) -> TrainingSummary:
    """`swarm train`: train for the configured steps, print and optionally save a summary."""
    trainer = Trainer(config)
    try:
        summary = run(trainer.train())
    finally:
        trainer.shutdown()
    print(
        f"Trained {summary.steps} steps ({summary.samples} samples) in {summary.seconds:.1f}s: "
        f"{summary.samples_per_second:.1f} samples/s; loss {summary.first_loss:.3f} -> {summary.last_loss:.3f}"
        f" (mean of the last steps); {summary.retries} retried calls",
        flush=True,
    )
    if config.summary_file:
        with open(config.summary_file, "w") as file:
            json.dump(asdict(summary), file, indent=1)
    if config.plot:  # last: a plot that cannot be written loses nothing above (PlotError reaches the command)
        from swarm.ops.plots import curves_from_summary, plot_training

        title = f"{config.model}, {config.num_stages} stages, data: {trainer.corpus.name}"
        print(f"loss plot: {plot_training([curves_from_summary(summary, config.model)], config.plot, title)}")
    return summary
