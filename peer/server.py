"""A peer process: hosts one stage, serves it over libp2p, announces itself, leaves cleanly."""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from swarm.compression import get_codec
from swarm.peer.checkpoint import load_checkpoint, restore, save_checkpoint
from swarm.peer.handler import StageHandler
from swarm.peer.mates import StageMates
from swarm.peer.preemption import notice_source, watch_for_preemption
from swarm.peer.runtime import StageRuntime
from swarm.proto import PROTOCOL_VERSION

from swarm.config import PeerConfig
from swarm.dht_node import connect_to_daemon, start_dht
from swarm.event_loop import run, stop_event_on_signals
from swarm.models import build_stage, get_model_spec
from swarm.optimizer import OptimizerSettings, build_optimizer
from swarm.stage_records import JOINING, LEAVING, SERVING, StageRecord, announce, fetch_stage_records
from swarm.transport import INFO_PROTOCOL, STAGE_PROTOCOL
from swarm.wire import WireLimits

logger = logging.getLogger(__name__)


class Peer:
    """One stage's host: the runtime, the handlers, the DHT announcements and the checkpoints."""

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.spec = get_model_spec(config.model)
        self.state = JOINING
        torch.set_num_threads(config.num_threads)
        # the DHT forks: create it before any thread exists
        self.dht = start_dht(config)
        self.peer_id = str(self.dht.peer_id)
        module = build_stage(self.spec, config.stage, config.num_stages, config.seed)
        settings = OptimizerSettings(config.lr, config.weight_decay, config.beta1, config.beta2)
        optimizer = build_optimizer(module, settings)
        step, samples_stepped = 0, 0
        if config.checkpoint_dir:
            checkpoint = load_checkpoint(config.checkpoint_dir, config.model, config.stage, config.num_stages)
            if checkpoint is not None:
                restore(checkpoint, module, optimizer)
                step, samples_stepped = checkpoint.step, checkpoint.samples_stepped
                logger.info(f"Resumed stage {config.stage} from its checkpoint at step {step}")
        self.runtime = StageRuntime(
            module,
            optimizer,
            config.target_batch_size,
            device=config.device,
            max_batch_samples=config.max_batch_samples,
            step=step,
            on_step=self._on_step,
            max_staleness=config.max_staleness,
        )
        self.runtime.samples_stepped = samples_stepped
        self.mates = StageMates(
            self.runtime,
            self.peer_id,
            config.model,
            averaging_timeout=config.averaging_timeout,
            codec=get_codec(config.averaging_codec),
        )
        max_bytes = int(config.max_request_mb * 2**20)
        self.handler = StageHandler(
            self.runtime,
            config.model,
            WireLimits(max_message_bytes=max_bytes, max_tensor_bytes=max_bytes),
            config.max_batch_samples,
            state=lambda: self.state,
            step_wait=config.averaging_timeout + 10,
            resyncs=lambda: self.mates.resyncs,
            lost_samples=lambda step: self.mates.short.get(step, {}),
        )
        self.mates.on_short = self.handler.notify_step
        self.loop: asyncio.AbstractEventLoop | None = None

    def _on_step(self, step: int) -> None:
        """Runs on the runtime thread after every step (or state taken from a mate)."""
        self.mates.on_step(step)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.handler.notify_step)
        if step % 10 == 0:
            logger.info(f"Stage {self.config.stage} reached step {step}")
        if self.config.checkpoint_dir and self.config.checkpoint_every and step % self.config.checkpoint_every == 0:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        path = save_checkpoint(
            self.config.checkpoint_dir,
            self.config.model,
            self.runtime.module,
            self.runtime.optimizer,
            self.runtime.step,
            self.runtime.samples_stepped,
        )
        logger.info(f"Saved checkpoint of step {self.runtime.step} to {path}")

    def record(self) -> StageRecord:
        config = self.config
        return StageRecord(
            peer_id=self.peer_id,
            stage=config.stage,
            model=config.model,
            num_stages=config.num_stages,
            state=self.state,
            step=self.runtime.step,
            throughput=self.runtime.throughput,
            queue_length=self.runtime.queue_length,
            target_batch_size=config.target_batch_size,
            stale_gradients=self.runtime.stale_gradients,
            protocol_version=PROTOCOL_VERSION,
        )

    async def _announce(self) -> None:
        await asyncio.get_running_loop().run_in_executor(
            None, announce, self.dht, self.config.run_id, self.record(), self.config.record_ttl
        )

    async def _read_mates(self) -> None:
        config = self.config
        records = await asyncio.get_running_loop().run_in_executor(
            None, lambda: fetch_stage_records(self.dht, config.run_id, config.num_stages, only=config.stage)
        )
        self.mates.update_records(records[config.stage])

    async def _announce_forever(self) -> None:
        while True:
            try:
                await self._announce()
                await self._read_mates()
            except Exception as e:
                logger.warning(f"Could not reach the DHT ({e}); retrying in {self.config.announce_period}s")
            await asyncio.sleep(self.config.announce_period)

    async def _join(self) -> None:
        """Announced as joining, takes the state of mates that are at this peer's step or ahead."""
        await self._announce()
        await self._read_mates()
        ahead = [r for r in self.mates.mates.values() if r.step >= self.runtime.step]
        if not ahead:
            return
        start = time.perf_counter()
        source = await self.mates.sync_from_mates(minimum_step=self.runtime.step)
        if source is None:
            logger.warning(
                f"No stage-mate gave its state; serving from step {self.runtime.step} and retrying as training goes"
            )
            return
        logger.info(
            f"Joined stage {self.config.stage} at step {self.runtime.step} in {time.perf_counter() - start:.2f}s"
        )

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
        return [first.to(self.runtime.device), extra.to(self.runtime.device)]

    async def serve(self) -> None:
        config = self.config
        stop = stop_event_on_signals()
        check = notice_source(config.preemption_notice)
        watching = asyncio.create_task(watch_for_preemption(check, config.preemption_poll, stop)) if check else None
        started = time.perf_counter()
        self.loop = asyncio.get_running_loop()
        throughput = self.runtime.measure_throughput(self._sample_batch())
        self.runtime.start()
        p2p = await connect_to_daemon(self.dht)
        await p2p.add_binary_stream_handler(STAGE_PROTOCOL, self.handler.handle_stage)
        await p2p.add_binary_stream_handler(INFO_PROTOCOL, self.handler.handle_info)
        await self.mates.start(p2p)
        await self._join()
        self.mates.start_serving()
        self.state = SERVING
        announcing = asyncio.create_task(self._announce_forever())
        maddrs = " ".join(str(m) for m in self.dht.get_visible_maddrs())
        logger.info(
            f"Serving stage {config.stage}/{config.num_stages} of {config.model} at step {self.runtime.step}, "
            f"{throughput:.1f} samples/s, {time.perf_counter() - started:.2f}s after start; peer id {self.peer_id}. "
            f"Others can join with --initial-peers {maddrs}"
        )
        await stop.wait()

        left_at = time.monotonic()
        logger.info("Leaving: no new requests; finishing those in flight")
        self.state = LEAVING
        announcing.cancel()
        if watching is not None:
            watching.cancel()
        try:
            await asyncio.wait_for(self._announce(), timeout=5)
        except Exception as e:
            logger.warning(f"Could not withdraw the DHT record ({e}); it expires in {config.record_ttl}s")
        deadline = time.monotonic() + config.shutdown_timeout
        while self.runtime.queue_length and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.mates.hand_over()
        self.mates.serving = False
        await self.mates.stop()
        logger.info(f"Left the swarm {time.monotonic() - left_at:.1f}s after the request to leave")
        for protocol in (STAGE_PROTOCOL, INFO_PROTOCOL):
            try:
                await p2p.remove_binary_stream_handler(protocol)
            except Exception as e:
                logger.debug(f"Could not remove handler {protocol}: {e}")

    def run(self) -> None:
        try:
            run(self.serve())
        finally:
            self.runtime.shutdown(timeout=self.config.shutdown_timeout)
            if self.config.checkpoint_dir:
                self.save_checkpoint()
            self.dht.shutdown()
            logger.info(f"Peer {self.peer_id} has left")


def run_peer(config: PeerConfig) -> None:
    """`swarm peer`: host one stage until SIGTERM or Ctrl-C."""
    Peer(config).run()
