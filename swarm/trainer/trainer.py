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

Each call goes through `stage_calls` (retries, rerouting, resends), which asks the router for a peer
and the transport to reach it; `peer_finder` keeps the router's view of the swarm fresh from the DHT.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from swarm.compression import CODECS
from swarm.compression.link_choice import CodecChooser, CodecProfile, activation_like, profile_codecs
from swarm.config import ConfigError, TrainerConfig
from swarm.models.precision import BOUNDARY_DTYPES, expected_dtype, flag_value
from swarm.net.dht_node import connect_to_daemon, start_dht
from swarm.net.direct_plane import DirectPlane
from swarm.net.link_shaper import LinkShape, LinkShaper
from swarm.policy.in_flight import InFlightGate, InFlightWindow
from swarm.policy.router import Router
from swarm.process.event_loop import run, stop_event_on_signals
from swarm.process.launch_clock import seconds_since_launch
from swarm.records.announced_settings import check_against_swarm
from swarm.records.sample_ledger import SampleLedger, fed_record
from swarm.records.stage_records import StageRecord
from swarm.records.trainer_records import TrainerProgress, direct_addresses, publish_forever, publish_now
from swarm.trainer.data import Corpus, load_corpus
from swarm.trainer.data_source import CorpusError
from swarm.trainer.microbatch_split import SplitPlan, plan_split
from swarm.trainer.outcome import TrainingError, TrainingSummary
from swarm.trainer.peer_finder import PeerFinder
from swarm.trainer.spot_checks import spot_checker
from swarm.trainer.stage_calls import StageCaller

if TYPE_CHECKING:
    from swarm.trainer.metrics import TrainerMetrics

logger = logging.getLogger(__name__)

WINDOW_FLOOR = 8  # microbatches in flight at least when the window follows the links
# the window before anything is measured: twice the floor, as TCP starts with ten segments rather than one. A
# guess too small costs a round trip per doubling, and a step whose last microbatches miss the window waits
# a whole pipeline round trip more for them; one too large only queues, and the first estimates shrink it
WINDOW_START = 16


class Trainer:
    """Drives training through the swarm found in the DHT."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.spec = config.model_spec()
        # the codecs are measured now, before the DHT forks (torch's threads must not exist yet), in each dtype
        # boundaries may travel in: which one this swarm uses is known once its records are read
        profiles: dict[torch.dtype, list[CodecProfile]] = {}
        if config.compression == "auto":
            sample = activation_like((config.microbatch_size, self.spec.seq_len, self.spec.boundary_width))
            profiles = {dtype: profile_codecs(CODECS.values(), sample.to(dtype)) for dtype in BOUNDARY_DTYPES}
        shaper = None
        if config.emulate_bandwidth_mbit or config.emulate_latency_ms:
            shaper = LinkShaper(
                LinkShape(config.emulate_bandwidth_mbit, config.emulate_latency_ms, config.emulate_own_link)
            )
        self.router = Router(
            deadline_floor=config.call_timeout_floor, deadline_ceiling=config.call_timeout, probation=True
        )
        self.summary = TrainingSummary()
        # the DHT forks: create it before the corpus or anything else starts threads
        self.dht = start_dht(config)
        try:
            # a model, cut or vocabulary other than the swarm's would only find no peer: say what to use instead
            swarm = check_against_swarm(config, self.dht, config.run_id)
            self.corpus = self._load_corpus()
        except (TrainingError, ConfigError):
            self.dht.shutdown()
            raise
        self.p2p: DirectPlane | None = None
        self.step = 0
        self.trainer_id = str(self.dht.peer_id)  # the caller id peers see: half of every microbatch's id
        self.ledger = SampleLedger(config.ledger)
        # random start: a restarted trainer with the same identity must not reuse microbatch ids
        self._microbatch_ids = random.getrandbits(62)
        self.in_flight_window: InFlightWindow | None = None  # without a fixed --max-in-flight
        # microbatches go whole, or in parts no peer refuses (`swarm.trainer.microbatch_split`)
        self.split = SplitPlan(config.microbatch_size, config.microbatch_size)
        # per stage, the step to ask a forward for: the one after the step its latest backwards reached
        self._want: dict[int, int] = {}
        self.peers = PeerFinder(self.dht, config, self.spec.vocab_size, self.router)
        boundary_dtype = expected_dtype(config.dtype, swarm.get("dtype"))
        chooser = None
        if profiles:
            chooser = CodecChooser(profiles.get(boundary_dtype, profiles[torch.float32]), config.max_codec_error)
        self.calls = StageCaller(
            config, self.spec, self.trainer_id, self.router, self.peers, self.summary, chooser, shaper
        )
        self.calls.dtype = boundary_dtype
        self.calls.spot_checks = spot_checker(config, self.calls, self.peers.accusations, self.trainer_id, self.dht)
        self.summary.dtype = flag_value(boundary_dtype) if boundary_dtype is not None else ""
        self.metrics: TrainerMetrics | None = None  # with --metrics-port
        self.progress = TrainerProgress(self.trainer_id, config.model, config.num_stages)  # for `swarm monitor`
        self._resends: set[asyncio.Task] = set()  # what short peers' records named of this trainer's, sent again
        self.peers.on_short = self._short_heard

    def _short_heard(self, stage: int, record: StageRecord) -> None:
        """A peer's record says its step is short: what it names of this trainer's goes again, in the background."""
        if any(entry[0] == self.trainer_id for entry in record.short):
            task = asyncio.ensure_future(self.calls.resend_listed(stage, record))
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)

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

    # --- microbatches and steps ----------------------------------------------------------------

    async def run_microbatch(self, tokens: torch.Tensor) -> float:
        """Forward and backward of one microbatch through every stage; returns its mean loss."""
        self._microbatch_ids += 1
        mb = self._microbatch_ids
        last = self.config.num_stages - 1
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        ids = [inputs] if self.spec.later_stages_take_tokens else []
        stage_inputs, versions, forward_peers = [[inputs]], [], []
        for stage in range(last):
            reply, (hidden,) = await self.calls.call(stage, False, stage_inputs[-1], mb, self._want[stage])
            stage_inputs.append([hidden, *ids])
            versions.append(reply.step)
            forward_peers.append(self.calls.served_by)
        reply, grads = await self.calls.call(last, True, [*stage_inputs[last], targets], mb, self._want[last])
        answered = [0.0] * last + [time.time()]  # when each stage served the backward, for the ledger
        for stage in reversed(range(last)):
            (grad,) = grads
            _, grads = await self.calls.call(stage, True, [*stage_inputs[stage], grad], mb, versions[stage])
            answered[stage] = time.time()
            if self.calls.served_by != forward_peers[stage]:  # stateless serving: any stage-mate can do it
                self.summary.backwards_moved += 1
        self.ledger.write(fed_record(self.trainer_id, mb, len(tokens), at=answered[0], stage_times=answered))
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
        part_size = self._split_plan().part_size

        async def limited(tokens: torch.Tensor) -> tuple[float, int]:
            nonlocal waiting
            async with gate as sent:
                waiting -= 1
                if not waiting and admitted is not None:
                    admitted.set()
                # a microbatch larger than some peer accepts goes as parts, each a microbatch of its own
                parts = tokens.split(part_size)
                losses = await gather_or_cancel([self.run_microbatch(part) for part in parts])
                gate.completed(len(tokens), sent)
                return sum(loss * len(part) for loss, part in zip(losses, parts)) / len(tokens), len(tokens)

        results = await gather_or_cancel([limited(mb) for mb in microbatches])
        # the next step's forwards ask each stage for the step after the one these backwards reached: a
        # stage that has its batch waits to get there, one still short of it serves at once
        for stage, reached in self.calls.reached.items():
            self._want[stage] = max(self._want.get(stage, 0), reached + 1)
        return sum(loss * n for loss, n in results) / sum(n for _, n in results)

    def _split_plan(self) -> SplitPlan:
        """How this step's microbatches go, from what the peers of every stage now announce (and what this
        trainer reads in a reply); said when it changes, with what to change to send them whole."""
        records = {stage: list(recs.values()) for stage, recs in self.router.records.items()}
        width, seq_len = self.spec.boundary_width, self.spec.seq_len
        # replies are read within limits sized to each call (`swarm.trainer.stage_calls`): no cap from them
        plan = plan_split(self.config.microbatch_size, records, width, seq_len, 0)
        if plan.part_size != self.split.part_size:
            (logger.warning if plan.part_size < self.config.microbatch_size else logger.info)(plan.notice())
        self.split = plan
        return plan

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
            reply, _ = await self.calls.call(stage, False, self._probe(stage), 0, step)
            if reply.step < step:
                logger.info(f"Stage {stage} is at step {reply.step}, waiting for other trainers' samples to step")
            return reply.step >= step

        try:
            return all(
                await asyncio.wait_for(
                    asyncio.gather(*(past(stage, reached + 1) for stage, reached in self.calls.reached.items())),
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
        """The bound on microbatches in flight: a fixed --max-in-flight, or a window sized from the pipeline (the
        trainer keeps one window for the whole run, so what it learned carries from step to step)."""
        fixed = self.config.max_in_flight
        if fixed is None and self.in_flight_window is None:
            # never below WINDOW_FLOOR (nor one per stage): a call held by a slow or silent peer then leaves
            # room for the rest, as the fixed window of that size did, on links whose product is smaller
            ceiling = self.config.in_flight_ceiling
            floor = min(ceiling, max(WINDOW_FLOOR, self.config.num_stages))
            self.in_flight_window = InFlightWindow(
                initial=WINDOW_START,  # within the floor and the ceiling, as every size of the window
                maximum=ceiling,
                minimum=floor,
                microbatch_samples=self.config.microbatch_size,
            )
        return InFlightGate(fixed or self.config.in_flight_ceiling, self.in_flight_window)

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
        from swarm.ops.prometheus import serve_metrics
        from swarm.trainer.metrics import TrainerMetrics

        self.metrics = TrainerMetrics(self.config, self.trainer_id, self.summary, self.router, lambda: self.step)
        self.calls.observer = self.metrics
        serve_metrics(self.metrics.registry, self.config.metrics_host, self.config.metrics_port)

    async def train(self) -> TrainingSummary:
        """Trains the configured steps (or until a stop is requested) and settles; returns the summary."""
        config = self.config
        if config.metrics_port is not None:
            self._start_metrics()
        stop = stop_event_on_signals()
        self.p2p = DirectPlane(
            await connect_to_daemon(self.dht), self.dht.identity, dial=config.direct, shared_memory=config.shared_memory
        )
        self.peers.p2p = self.calls.p2p = self.p2p
        if self.calls.spot_checks is not None:
            self.calls.spot_checks.p2p = self.p2p
        self.progress.addresses = await direct_addresses(self.p2p)
        refreshing = asyncio.create_task(self.peers.refresh_forever())
        publishing = asyncio.create_task(publish_forever(self.dht, config.run_id, self.progress))
        steps: AsyncGenerator[float, None] | None = None
        try:
            target_batch_size, self.step = await self.peers.wait_for_swarm()
            self._want = {stage: self.step for stage in range(config.num_stages)}
            summary = self.summary
            summary.found_swarm_after_launch_s = round(seconds_since_launch(), 3)
            logger.info(
                f"Found all {config.num_stages} stages of {config.model} {summary.found_swarm_after_launch_s:.2f}s "
                f"after launch; training {config.steps} steps of {target_batch_size} samples from step {self.step}"
            )
            summary.first_step = self.step
            self._split_plan()  # before the first call: a microbatch larger than some peer accepts is said now
            await self.calls.trials.first_contact(self._probe, config.num_stages, self.step)
            start = time.perf_counter()
            self.progress.begin()
            bar = tqdm(total=config.steps, desc="training", unit="step", disable=not config.progress, mininterval=1.0)
            steps = self._steps(config.steps, target_batch_size, stop)
            async for loss in steps:  # the generator is closed in `finally`, whatever happens here
                self._step_done(loss, target_batch_size, start, bar)
            bar.close()
            if not stop.is_set():
                await self._settle_unless_stopped(stop)
        finally:
            if steps is not None:
                await steps.aclose()
            refreshing.cancel()
            publishing.cancel()
            for task in list(self._resends):
                task.cancel()
            await self.calls.trials.stop()
            self.summary.trial_forwards = {"passed": self.calls.trials.passed, "failed": self.calls.trials.failed}
            if self.calls.spot_checks is not None:
                await self.calls.spot_checks.stop()
                self.summary.spot_checks = asdict(self.calls.spot_checks.counts)
        # the steps since the last periodic record: a monitor shows where this trainer ended, not a step before;
        # and that it finished, so that a stage short of its lost samples steps without them at once
        self.progress.finished = True
        if not await publish_now(self.dht, config.run_id, self.progress):
            logger.warning("Could not publish this trainer's final progress; monitors show its last record before")
        return self._finish_summary()

    def _step_done(self, loss: float, target_batch_size: int, start: float, bar: tqdm) -> None:
        """Counts a finished step in the summary, the metrics, the published progress and the progress bar."""
        config, summary = self.config, self.summary
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

    async def _settle_unless_stopped(self, stop: asyncio.Event) -> None:
        """Settles after the last step (see `settle`) unless a stop is requested first; notes it in the summary."""
        summary = self.summary
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

    def _finish_summary(self) -> TrainingSummary:
        """The summary with what is known only at the end: codecs, calls per path, the window, the losses."""
        summary = self.summary
        if self.calls.chooser is not None:
            summary.codecs = self.calls.chooser.choices()
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
        """Stops the trainer's DHT (and its daemon)."""
        self.dht.shutdown()


async def gather_or_cancel(coroutines: list) -> list:
    """Their results, in order; where one fails, the others are cancelled and awaited before its error is
    raised, so that none is left running, or failing later with nobody to hear it."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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
