"""A peer process: hosts a stage, serves it over libp2p, announces itself, moves where needed, leaves cleanly."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from hivemind.p2p import P2P

from swarm.compression import get_codec
from swarm.config import ConfigError, PeerConfig
from swarm.models import compile_blocks, initial_stage
from swarm.models.hf_checkpoint import CheckpointError
from swarm.models.optimizer import OptimizerSettings, build_optimizer, import_compiler_in_background
from swarm.models.precision import compute_dtype, flag_value
from swarm.net.allowlist import StreamGate
from swarm.net.dht_node import connect_to_daemon, start_dht
from swarm.net.direct_plane import DirectPlane, announce_host, listen_host
from swarm.net.reachability import REACH_PROTOCOL, check_before_start, report_reachability, serve_reachability
from swarm.net.request_budget import RequestBudget
from swarm.net.request_limits import StageLimits, stage_limits
from swarm.net.transport import INFO_PROTOCOL, STAGE_PROTOCOL, STANDBY_PROTOCOL
from swarm.peer.announcer import Announcer
from swarm.peer.checkpoint import checkpoint_name, checkpoint_path, resume_stage, save_checkpoint
from swarm.peer.direct_links import keep_direct_links
from swarm.peer.faults import FaultPlan
from swarm.peer.handler import StageHandler
from swarm.peer.inference_handler import inference_handler, uplink_turns
from swarm.peer.mates import StageMates
from swarm.peer.preemption import notice_source, watch_for_preemption
from swarm.peer.rebalancing import Rebalancing
from swarm.peer.runtime import StageRuntime
from swarm.peer.stage_state import parameter_fingerprint
from swarm.peer.standby import StandbyKeeper
from swarm.peer.standby_copy import Standby
from swarm.peer.step_deltas import DELTA_INTEREST, DeltaRing
from swarm.peer.work_receipts import work_receipts
from swarm.policy.balance import stage_costs
from swarm.process.event_loop import run, stop_event_on_signals
from swarm.process.launch_clock import seconds_since_launch, startup_breakdown
from swarm.proto import PROTOCOL_VERSION
from swarm.records.sample_ledger import SampleLedger
from swarm.records.stage_records import (
    JOINING,
    LEAVING,
    MAX_CAUGHT,
    SERVING,
    StageRecord,
    announce,
    fetch_stage_records,
    short_entries,
)

if TYPE_CHECKING:
    from swarm.peer.metrics import PeerMetrics

logger = logging.getLogger(__name__)


class Peer:
    """A host of one stage at a time: the runtime, the handlers, the announcements and the checkpoints.

    It starts on the stage given, or with `--stage auto` on the swarm's bottleneck, and every
    `--rebalance-period` (randomised) it applies the balance rule (`swarm.peer.rebalancing`): if the rule
    moves it, it leaves its stage as on a graceful leave (handing its gradients to its mates) and
    joins the bottleneck, downloading that stage's state from the peers there.
    """

    def __init__(self, config: PeerConfig) -> None:
        # seconds after launch at each start-up milestone, for the first "Serving" line
        self.startup = {"imports": seconds_since_launch()}
        self.config = config
        self.spec = config.model_spec()  # with --vocab-size, which the record announces for trainers to check
        self.costs = stage_costs(self.spec, config.num_stages)
        self.state = JOINING
        self.moves = 0
        self.movable = config.rebalance_period > 0  # pinned otherwise: it never rebalances, and says so
        self.faults = FaultPlan(config.faults)
        self.ledger = SampleLedger(config.ledger)
        self.rng = random.Random()
        torch.set_num_threads(config.num_threads)
        # before the DHT: the answer decides whether its daemon serves directly or through a relay
        self.reachability = check_before_start(config)
        # the DHT forks: create it before any thread exists
        self.dht = start_dht(config, reachable=self.reachability.for_daemon)
        self.startup["DHT"] = seconds_since_launch()
        self.peer_id = str(self.dht.peer_id)
        self.gate = StreamGate(self.dht.allowlist, config.max_streams_per_caller)
        self.stage: int = config.initial_stage if config.initial_stage is not None else -1
        self.runtime: StageRuntime | None = None
        self.mates: StageMates | None = None
        self.handler: StageHandler | None = None
        self.limits: StageLimits | None = None  # what the stage's calls may carry; announced in the record
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics: PeerMetrics | None = None  # with --metrics-port
        self.net: DirectPlane | None = None  # libp2p and the direct data plane, once serving
        # standby copies of other stages (--standby-stages), and the restore of a stage all of whose peers died
        self.standbys = StandbyKeeper(self) if config.standby_stages > 0 else None
        self._moves: asyncio.Queue[int] | None = None  # where `serve` takes the next move from
        self.restored_from_standby = False
        self.moving_to = -1  # while leaving for another stage by the balance rule: that stage
        self.rebalancing = Rebalancing(self, self._fetch_records, self._announce)
        self.announcer = Announcer(self._store, self._renewal, config.announce_period, name="swarm-announcer")

    def _build(self, stage: int, resume: bool, standby: Standby | None = None) -> None:
        """Builds the stage's module, optimizer, runtime, mates and handler (from a checkpoint or a copy if asked)."""
        config = self.config
        self.stage = stage
        try:  # from --hf-checkpoint's weights if given, else fresh from the seed
            module = initial_stage(self.spec, stage, config.num_stages, config.seed, config.hf_checkpoint)
        except CheckpointError as e:
            raise ConfigError(f"--hf-checkpoint: {e}") from None
        if config.compile:
            compile_blocks(module)
        settings = OptimizerSettings(config.lr, config.weight_decay, config.beta1, config.beta2)
        optimizer = build_optimizer(module, settings)
        step, samples_stepped = 0, 0
        if resume and config.checkpoint_dir:
            name = checkpoint_name(config.model, self.spec.stage_blocks)
            step, samples_stepped = resume_stage(config.checkpoint_dir, name, module, optimizer)
        self.restored_from_standby = standby is not None  # then its own copy is the freshest it could find
        if standby is not None:
            self.standbys.restore_into(standby, module, optimizer)
            step, samples_stepped = standby.step, standby.samples_stepped
        simulated = config.simulated_speed / self.costs[stage] if config.simulated_speed else 0.0
        self.runtime = StageRuntime(
            module,
            optimizer,
            config.target_batch_size,
            device=config.device,
            max_batch_samples=config.max_batch_samples,
            # offloaded, a batch pays one pass of loads however large: merge all that is queued
            max_batch_seconds=0.0 if config.offload else config.max_batch_seconds,
            step=step,
            on_step=self._on_step,
            max_staleness=config.max_staleness,
            simulated_speed=simulated,
            faults=self.faults,
            max_queue=config.max_queue,
            offload=config.offload,
            offload_group=config.offload_group,
            dtype=compute_dtype(config.dtype, config.device),
        )
        self.runtime.samples_stepped = samples_stepped
        self.mates = StageMates(
            self.runtime,
            self.peer_id,
            config.model,
            averaging_timeout=config.averaging_timeout,
            codec=get_codec(config.averaging_codec),
            short_wait=config.short_wait,
            faults=self.faults,
            ledger=self.ledger,
            receipts=work_receipts(config, self.peer_id, module.stage),
            robust_sum=config.robust_sum,
        )
        self.runtime.deltas = self._delta_ring()
        self.limits = stage_limits(module, config.max_call_samples, int(config.max_request_mb * 2**20))
        self.handler = StageHandler(
            self.runtime,
            config.model,
            self.limits.wire,
            self.limits.max_call_samples,
            state=lambda: self.state,
            mates=self.mates,
            step_wait=config.averaging_timeout + 10,
            faults=self.faults,
            metrics=self.metrics,
            budget=RequestBudget(int(config.request_memory_mb * 2**20), self.limits.wire.max_message_bytes),
            inference=inference_handler(self.runtime, self.limits.wire, self.limits.max_call_samples, config),
            uplink=uplink_turns(config),
        )
        if self.metrics is not None:
            self.metrics.host(self.runtime, self.mates, self.handler.inference)
        self.mates.on_phase = self.handler.notify_step
        self.runtime.on_stepped = self._on_stepped
        self.mates.refresh_records = self._read_mates
        self.mates.membership.watch_accusations(self.dht, config.trust_root, config.run_id)  # spot checks' verdicts
        self.mates.watch_departures(self.dht, config.run_id)  # a short step waits for no trainer that finished
        # a peer unknown to the stage asking for its state may be a new standby holder: a read of every stage shows it
        self.mates.refresh_holders = self._refresh_whole_swarm if self.standbys is not None else None

    def _on_stepped(self, step: int) -> None:
        """At once after every step, on the runtime thread: forwards waiting for the step go ahead."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.handler.notify_step)

    def _on_step(self, step: int, fingerprint: str) -> None:
        """Runs after every step, once its fingerprint is known (or state taken from a mate)."""
        self.mates.on_step(step, fingerprint)
        if self.metrics is not None:
            self.metrics.stepped(self.runtime.last_round)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._after_step)
        if step % 10 == 0:
            logger.info(f"Stage {self.stage} reached step {step}")
        if self.config.checkpoint_dir and self.config.checkpoint_every and step % self.config.checkpoint_every == 0:
            self.save_checkpoint()

    def _after_step(self) -> None:
        self.handler.notify_step()
        if self.faults.faults:
            asyncio.ensure_future(self.faults.hit("after_step", act=self._perturb))

    async def _perturb(self) -> None:
        """A fault for tests: nudges the parameters, as a replica that went wrong would hold others."""
        runtime = self.runtime

        def nudge() -> None:
            runtime.settle_fingerprint()
            with torch.no_grad():
                next(runtime.module.parameters()).add_(1e-3)
            runtime.version = (runtime.step, parameter_fingerprint(runtime.module))

        await asyncio.wrap_future(runtime.run_exclusive(nudge))

    def save_checkpoint(self) -> None:
        runtime, name = self.runtime, checkpoint_name(self.config.model, self.spec.stage_blocks)
        state = (runtime.module, runtime.optimizer, runtime.step, runtime.samples_stepped)
        path = save_checkpoint(self.config.checkpoint_dir, name, *state)
        logger.info(f"Saved checkpoint of step {self.runtime.step} to {path}")

    def record(self) -> StageRecord:
        config = self.config
        lost = self.mates.lost() if self.mates is not None and self.state == SERVING else {}
        return StageRecord(
            peer_id=self.peer_id,
            stage=self.stage,
            model=config.model,
            num_stages=config.num_stages,
            state=self.state,
            step=self.runtime.step,
            versions=tuple(self.mates.recent_versions) if self.mates is not None else (),
            throughput=self.runtime.throughput,
            queue_length=self.runtime.queue_length,
            target_batch_size=config.target_batch_size,
            stale_gradients=self.runtime.stale_gradients,
            protocol_version=PROTOCOL_VERSION,
            movable=self.movable,
            vocab_size=self.spec.vocab_size,
            standbys=self.standbys.announced() if self.standbys is not None else (),
            moving_to=self.moving_to if self.state == LEAVING else -1,
            direct=self.net.address if self.net is not None else "",
            max_microbatch=self.limits.max_microbatch,
            dtype=flag_value(self.runtime.dtype),
            caught=tuple(self.mates.membership.caught)[:MAX_CAUGHT] if self.mates is not None else (),
            saw_death=self.standbys.saw_death() if self.standbys is not None else False,
            empty=self.standbys.announced_empty() if self.standbys is not None else (),
            stage_blocks=self.spec.stage_blocks,
            short_step=self.runtime.step if lost else -1,
            short=short_entries(lost),  # trainers whose calls wait at another stage read what to send again here
        )

    def _renewal(self) -> StageRecord | None:
        """The record the announcer renews; None while a mover has built its target but not announced it yet
        (its record on the source, naming the target, holds until then)."""
        if self.state == LEAVING and self.moving_to == self.stage:
            return None
        return self.record()

    def request_move(self, stage: int) -> None:
        """Asks `serve` to move this peer to `stage` (as a balance move does), if it is serving."""
        if self._moves is not None and self.state == SERVING:
            self._moves.put_nowait(stage)
        elif self.standbys is not None:
            self.standbys.move_failed()

    async def _announce(self, record: StageRecord | None = None) -> None:
        if self.announcer.running:  # in order with the renewals, the record built when it is stored
            await asyncio.wrap_future(self.announcer.announce_now(record))
            return
        record = record or self.record()
        await asyncio.get_running_loop().run_in_executor(None, self._store, record)

    def _store(self, record: StageRecord) -> None:
        announce(self.dht, self.config.run_id, record, self.config.record_ttl)

    async def _fetch_records(self, only: int | Iterable[int] | None = None) -> dict[int, list[StageRecord]]:
        config = self.config
        records = await asyncio.get_running_loop().run_in_executor(
            None, lambda: fetch_stage_records(self.dht, config.run_id, config.num_stages, only=only)
        )
        if self.net is not None:
            self.net.learn(r for stage_records in records.values() for r in stage_records)
        return records

    async def _open_network(self) -> DirectPlane:
        """The peer's P2P, and its direct data plane unless --direct-port -1 (announced unless unreachable)."""
        config = self.config
        self.net = DirectPlane(
            await connect_to_daemon(self.dht), self.dht.identity, dial=config.direct, shared_memory=config.shared_memory
        )
        if self.standbys is not None:  # a call that finds a peer gone wakes the keeper: its stage may be lost
            self.net.on_gone.append(self.standbys.probes.note_refused)
        if config.direct_port < 0:
            return self.net
        host = listen_host(config.host_maddrs)
        visible = [str(m) for m in await self.net.get_visible_maddrs()]
        announced = config.direct_host or announce_host(host, [*config.announce_maddrs, *visible])
        if self.reachability.reachable is False and not config.direct_host:
            announced = ""  # behind NAT: nobody outside could dial it; callers go through libp2p
        try:
            await self.net.serve(host, config.direct_port, announced)
        except OSError as e:
            raise ConfigError(
                f"--direct-port: cannot listen on {host}:{config.direct_port} ({e}); pick a free port, 0 for any, "
                "or -1 for no direct data plane"
            ) from None
        return self.net

    async def _read_mates(self) -> None:
        records = await self._fetch_records(only=self.stage)
        self.mates.update_records(records[self.stage])

    async def _read_records(self, whole_swarm: bool = False) -> None:
        """This period's read: the stage's own records for the mates and, for the standby keeper, those of the
        stages it holds copies of (of every stage now and then, when the keeper needs them, or if asked).

        One read serves both, and reads every stage only when needed: with every stage read every period,
        the DHT processes' CPU per training step nearly doubled (scripts/bench_standby.py)."""
        keeper = self.standbys
        if keeper is None:
            return await self._read_mates()
        stage = self.stage
        wanted = None if whole_swarm else keeper.stages_to_read()
        records = await self._fetch_records(only=wanted)
        if self.stage != stage:
            return  # moved meanwhile: the next read is for the new stage
        self.mates.update_records(records[stage])
        keeper.observe(records, whole_swarm=wanted is None)

    async def _refresh_whole_swarm(self) -> None:
        await self._read_records(whole_swarm=True)

    async def _announce_forever(self) -> None:
        """Renews the record from the announcer's thread, and reads the stage-mates' records every period (sooner
        when a probe found a peer newly silent). The reads stay on the loop, apart: one that takes tens of seconds
        under load must not hold back the next renewal, or the record lapses while the peer is alive."""
        if not self.announcer.running:
            self.announcer.start()
        period = self.config.announce_period
        while True:
            try:
                await self._read_records()
            except Exception as e:
                logger.warning(f"Could not reach the DHT ({e}); retrying in {period}s")
            await (self.standbys.probes.until_news(period) if self.standbys is not None else asyncio.sleep(period))

    async def _join(self) -> None:
        """Announced as joining, takes the state of mates that are at this peer's step or ahead."""
        await self._announce()
        await self._read_mates()
        if self.restored_from_standby:
            await self.standbys.settle_restore()
        ahead = [r for r in self.mates.mates.values() if r.step >= self.runtime.step]
        # on a stage with no live mate, a standby copy brings the stage back (unless this peer just restored it)
        fetch_copy = self.standbys is not None and not self.restored_from_standby
        if not ahead:
            if not self.mates.mates and fetch_copy:
                await self.standbys.fetch_for_newcomer()
            return
        start = time.perf_counter()
        source = await self.mates.sync_from_mates(minimum_step=self.runtime.step)
        # the mates' records may be the last words of peers that died
        if source is None and fetch_copy and await self.standbys.fetch_for_newcomer():
            return
        if source is None:  # after a restore, the records are the last words of the peers the copy stands for
            copy = "the standby copy's " if self.restored_from_standby else ""
            (logger.info if copy else logger.warning)(
                f"No stage-mate gave its state; serving from {copy}step {self.runtime.step}, retrying as training goes"
            )
            return
        logger.info(f"Joined stage {self.stage} at step {self.runtime.step} in {time.perf_counter() - start:.2f}s")

    def _sample_batch(self) -> list[torch.Tensor]:
        """A small batch of the stage's backward inputs, to measure its speed at start-up."""
        spec, stage = self.spec, self.runtime.module
        batch, seq = 2, spec.seq_len
        first = (
            torch.randint(0, spec.vocab_size, (batch, seq))
            if stage.is_first
            else torch.randn(batch, seq, spec.boundary_width)
        )
        extra = (
            torch.randint(0, spec.vocab_size, (batch, seq))
            if stage.is_last
            else torch.randn(batch, seq, spec.boundary_width)
        )
        ids = [torch.randint(0, spec.vocab_size, (batch, seq))] if stage.takes_tokens else []
        return [tensor.to(self.runtime.device) for tensor in (first, *ids, extra)]

    async def _handle_stage(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.handler.handle_stage(stream_info, reader, writer)

    def _delta_ring(self) -> DeltaRing | None:
        """Where the stage keeps its last steps' deltas for standby holders (`--standby-deltas`), if it does."""
        config, mates = self.config, self.mates
        if not config.standby_deltas or config.offload:  # a spilled stage's optimizer steps in its own order
            return None
        return DeltaRing(config.standby_deltas, wanted=lambda: bool(mates.standby_holders), interest=DELTA_INTEREST)

    async def _handle_info(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.handler.handle_info(stream_info, reader, writer)

    def _admit(self, handler, protocol: str):
        """A protocol's handler behind the peer's gate: the swarm's allowlist, and streams per caller."""
        if self.metrics is not None:
            handler = self.metrics.counting(handler, protocol)
        return self.gate.guard(handler, protocol)

    def _start_metrics(self) -> None:
        """--metrics-port: serves the peer's Prometheus metrics (ConfigError if the address cannot be bound)."""
        from swarm.ops.prometheus import serve_metrics
        from swarm.peer.metrics import PeerMetrics

        self.metrics = PeerMetrics(self)
        serve_metrics(self.metrics.registry, self.config.metrics_host, self.config.metrics_port)

    async def _host(self, p2p: P2P) -> float:
        """Starts the built stage: measures its speed, takes its mates' state, serves; returns samples/s."""
        self.state = JOINING
        self.moving_to = -1
        throughput = self.runtime.measure_throughput(self._sample_batch())
        self.runtime.start()
        await self.mates.start(p2p, self._admit)
        await self._join()
        self.mates.start_serving()
        self.state = SERVING
        await self._announce()
        return throughput

    async def _leave_stage(self) -> None:
        """Stops taking work on this stage, finishes what is queued and hands un-averaged gradients to mates."""
        self.state = LEAVING
        if self.handler is not None:
            self.handler.notify_step()  # calls waiting for a step this peer will not take are answered now
        try:
            await asyncio.wait_for(self._announce(), timeout=5)
        except Exception as e:
            logger.warning(f"Could not withdraw the DHT record ({e}); it expires in {self.config.record_ttl}s")
        deadline = time.monotonic() + self.config.shutdown_timeout
        while self.runtime.queue_length and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.mates.hand_over()
        self.mates.serving = False
        await self.mates.stop()

    async def serve(self) -> None:
        """Hosts a stage until asked to leave: serves it, moves where the balance rule sends it, then leaves."""
        config = self.config
        if config.metrics_port is not None:
            self._start_metrics()
        stop = stop_event_on_signals()
        check = notice_source(config.preemption_notice)
        watching = asyncio.create_task(watch_for_preemption(check, config.preemption_poll, stop)) if check else None
        started = time.perf_counter()
        self.loop = asyncio.get_running_loop()
        p2p = await self._open_network()
        if self.stage < 0:
            self.stage = await self.rebalancing.choose_stage()
        gc.freeze()  # before any stage: a move's gc.collect() then walks only what came since, not torch (0.28 s)
        self._build(self.stage, resume=True)
        self.startup["stage built"] = seconds_since_launch()
        await self._add_handlers(p2p)
        background = self._keep_reachable(p2p)
        announcing: asyncio.Task | None = None
        try:
            while True:
                throughput = await self._host(p2p)
                since = f"{time.perf_counter() - started:.2f}s after start"
                if announcing is None:
                    announcing = asyncio.create_task(self._announce_forever())
                    background.append(announcing)
                    import_compiler_in_background()  # serving already: see swarm.models.optimizer
                    self.startup["joined"] = seconds_since_launch()
                    since = f"{self.startup['joined']:.2f}s after launch ({startup_breakdown(self.startup)})"
                self._log_serving(throughput, since)
                target = await self._next_move(stop)
                if target is None:
                    break
                await self._move_to(target)
                started = time.perf_counter()
        finally:
            for task in background:
                task.cancel()
            if self.standbys is not None:
                self.standbys.stop()
        await self._leave_swarm(p2p, watching)

    async def _add_handlers(self, p2p: P2P) -> None:
        """Serves the peer's protocols over libp2p, each behind the peer's gate."""
        await p2p.add_binary_stream_handler(STAGE_PROTOCOL, self._admit(self._handle_stage, STAGE_PROTOCOL))
        await p2p.add_binary_stream_handler(INFO_PROTOCOL, self._admit(self._handle_info, INFO_PROTOCOL))
        await serve_reachability(p2p, self._admit)
        if self.standbys is not None:
            await p2p.add_binary_stream_handler(
                STANDBY_PROTOCOL, self._admit(self.standbys.handle_standby, STANDBY_PROTOCOL)
            )

    def _keep_reachable(self, p2p: P2P) -> list[asyncio.Task]:
        """Tasks for as long as the peer serves: reporting its reachability and, behind NAT, its direct links."""
        config = self.config
        tasks = [
            asyncio.create_task(
                report_reachability(self.reachability, config, lambda: p2p.get_visible_maddrs(latest=True))
            )
        ]
        # behind NAT: trainers' calls come over connections this peer opens, not through the relay
        if self.reachability.reachable is False:
            tasks.append(asyncio.create_task(keep_direct_links(p2p, self.dht, config.run_id)))
        return tasks

    def _log_serving(self, throughput: float, since: str) -> None:
        config = self.config
        maddrs = " ".join(str(m) for m in self.dht.get_visible_maddrs())
        logger.info(
            f"Serving stage {self.stage}/{config.num_stages} of {config.model} at step {self.runtime.step}, "
            f"{throughput:.1f} samples/s, {since}; peer id {self.peer_id}. Others can join with "
            f"--initial-peers {maddrs}"
        )

    async def _next_move(self, stop: asyncio.Event) -> int | None:
        """The next move that leaves a live peer on this stage (see `StageMates.another_serves`): its target stage,
        or None once the peer is asked to leave."""
        while (target := await self._wait_for_move(stop)) is not None and not await self.mates.another_serves():
            logger.warning(f"Not moving to stage {target}: no other peer of stage {self.stage} answers; it stays")
            if self.standbys is not None:
                self.standbys.move_failed()
        return target

    async def _wait_for_move(self, stop: asyncio.Event) -> int | None:
        """Waits for a move (the balance rule's, or `request_move`'s): its target, or None once asked to leave."""
        move_to: asyncio.Queue[int] = asyncio.Queue()
        self._moves = move_to
        balancing = asyncio.create_task(self.rebalancing.run(move_to)) if self.movable else None
        moving = asyncio.create_task(move_to.get())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([moving, stopping], return_when=asyncio.FIRST_COMPLETED)
        for task in (balancing, moving, stopping):
            if task is not None:
                task.cancel()
        if stop.is_set():
            return None
        self._moves = None
        return moving.result()

    async def _move_to(self, target: int) -> None:
        """Leaves this stage as on a graceful leave, then builds `target` (from a standby copy if it holds one)."""
        config = self.config
        left_at = time.monotonic()
        source = self.stage
        self.moving_to = target  # named in its leaving record: a filler too, so that a second one stays put
        await self._leave_stage()
        self.runtime.shutdown(timeout=config.shutdown_timeout)
        if config.checkpoint_dir:  # a restart resumes the stage this peer hosts, not one it left
            checkpoint_path(
                config.checkpoint_dir, checkpoint_name(config.model, self.spec.stage_blocks), source, config.num_stages
            ).unlink(missing_ok=True)
        self._build(target, resume=False, standby=self.standbys.claim(target) if self.standbys else None)
        gc.collect()  # the old stage's runtime sits in reference cycles: its device memory goes now, not at random
        self.moves += 1
        logger.info(f"Left stage {source} in {time.monotonic() - left_at:.1f}s; joining stage {target}")

    async def _leave_swarm(self, p2p: P2P, watching: asyncio.Task | None) -> None:
        """Asked to leave: finishes the requests in flight, hands over as on a move, and closes its protocols."""
        left_at = time.monotonic()
        logger.info("Leaving: no new requests; finishing those in flight")
        if watching is not None:
            watching.cancel()
        await self._leave_stage()
        logger.info(f"Left the swarm {time.monotonic() - left_at:.1f}s after the request to leave")
        for protocol in (STAGE_PROTOCOL, INFO_PROTOCOL, REACH_PROTOCOL, STANDBY_PROTOCOL):
            try:
                await p2p.remove_binary_stream_handler(protocol)
            except Exception as e:
                logger.debug(f"Could not remove handler {protocol}: {e}")

    def run(self) -> None:
        try:
            run(self.serve())
        finally:
            if self.runtime is not None:
                self.runtime.shutdown(timeout=self.config.shutdown_timeout)
                if self.config.checkpoint_dir:
                    self.save_checkpoint()
            self.announcer.stop()
            self.dht.shutdown()
            logger.info(f"Peer {self.peer_id} has left")


def run_peer(config: PeerConfig) -> None:
    """`swarm peer`: host one stage until SIGTERM or Ctrl-C."""
    Peer(config).run()
