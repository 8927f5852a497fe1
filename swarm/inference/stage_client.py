"""Calls to the swarm's stages for inference: a serving peer per stage, picked by speed, others on failure.

Peers come from the stages' records in the DHT, those of this model and cut that serve; each call goes to
one of them, picked at random weighted by its announced speed, and a peer that fails a call is avoided
for the rest of it. Every call is an INFER call (`swarm.peer.inference_handler`): forward only, from the
peer's live weights, below its training work.
"""

from __future__ import annotations

import asyncio
import logging
import random

import torch
from hivemind.p2p import PeerID

from swarm.compression import get_codec
from swarm.config.inference_settings import InferenceConfig
from swarm.models.stage_io import StageOutputError, check_stage_outputs
from swarm.net.direct_plane import DirectPlane
from swarm.net.transport import StageCallError, call_stage
from swarm.proto import INFER, ErrorCode, StageReply, StageRequest
from swarm.records.stage_records import SERVING, StageRecord, fetch_stage_records

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 2.0  # how often the records are read again while a stage has no peer to call
MIN_WEIGHT = 1e-3  # a peer that has not measured its speed yet still gets picked now and then


class NoPeerError(RuntimeError):
    """A stage has had no serving peer to call for longer than the caller waits."""


class StageClient:
    """Picks peers and makes INFER calls for one model of the swarm (see the module's docstring)."""

    def __init__(self, dht, config: InferenceConfig, p2p: DirectPlane) -> None:
        self.dht = dht
        self.config = config
        self.p2p = p2p
        self.records: dict[int, list[StageRecord]] = {}
        self.calls = 0
        self.failures = 0

    async def refresh(self) -> None:
        """Reads the stages' records again: the serving peers of this model and cut."""
        config = self.config
        records = await asyncio.get_running_loop().run_in_executor(
            None, fetch_stage_records, self.dht, config.run_id, config.num_stages
        )
        ours = (config.model, config.num_stages)
        self.records = {
            stage: [r for r in recs if r.state == SERVING and (r.model, r.num_stages) == ours]
            for stage, recs in records.items()
        }
        self.p2p.learn(r for recs in self.records.values() for r in recs)

    async def wait_for_swarm(self) -> None:
        """Waits until every stage has a serving peer; NoPeerError after --swarm-wait seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.swarm_wait
        while True:
            await self.refresh()
            empty = [s for s in range(self.config.num_stages) if not self.records.get(s)]
            if not empty:
                return
            if loop.time() > deadline:
                raise NoPeerError(
                    f"stage(s) {empty} of {self.config.model} have no serving peer after {self.config.swarm_wait:.0f}s "
                    f"(run {self.config.run_id!r}, {self.config.num_stages} stages): is the swarm up, and are the "
                    "--model, --num-stages and --run-id those its peers use?"
                )
            await asyncio.sleep(REFRESH_SECONDS)

    def pick(self, stage: int, avoid: set[str]) -> str | None:
        """A serving peer of `stage` not in `avoid`, at random weighted by its announced speed (None: none left)."""
        choices = [r for r in self.records.get(stage, []) if r.peer_id not in avoid]
        if not choices:
            return None
        weights = [max(r.throughput, MIN_WEIGHT) for r in choices]
        return random.choices(choices, weights)[0].peer_id

    async def call(
        self,
        stage: int,
        peer: str,
        tensors: list[torch.Tensor],
        session: str = "",
        position: int = 0,
        end: bool = False,
    ) -> tuple[StageReply, list[torch.Tensor]]:
        """One INFER call to `peer`; its reply and tensors, or StageCallError."""
        request = StageRequest(
            kind=INFER,
            model=self.config.model,
            stage=stage,
            session=session,
            position=position,
            end_session=end,
            reply_codec="none",
        )
        self.calls += 1
        try:
            reply, outputs = await call_stage(
                self.p2p, PeerID.from_base58(peer), request, tensors, get_codec("none"), self.config.call_timeout
            )
            if tensors:
                self._check(stage, tensors, outputs, peer)
            return reply, outputs
        except StageCallError:
            self.failures += 1
            raise

    def _check(self, stage: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], peer: str) -> None:
        """A reply that does not hold what the call asked for is the peer's fault: StageCallError, and the call goes
        to another peer."""
        spec, num_stages = self.config.model_spec(), self.config.num_stages
        try:
            if stage < num_stages - 1:
                check_stage_outputs(stage, num_stages, spec.boundary_width, False, inputs, outputs, None)
                return
            batch = inputs[0].shape[0]
            expected = (
                (batch,)
                if len(inputs) > 1 + (stage > 0 and spec.later_stages_take_tokens)
                else (batch, spec.vocab_size)
            )
            if len(outputs) != 1 or outputs[0].dtype != torch.float32 or tuple(outputs[0].shape) != expected:
                raise StageOutputError(
                    f"stage {stage} answered {[tuple(t.shape) for t in outputs]}, expected {expected}"
                )
            if not torch.isfinite(outputs[0]).all():
                raise StageOutputError(f"stage {stage} answered values that are not finite")
        except StageOutputError as e:
            raise StageCallError(ErrorCode.INTERNAL, f"bad reply: {e}", peer) from None

    async def call_any(self, stage: int, tensors: list[torch.Tensor]) -> tuple[StageReply, list[torch.Tensor]]:
        """A call with no session to any peer of `stage`, tried on others (and after reading the records again)
        up to --max-retries times; the last error if every attempt failed."""
        avoid: set[str] = set()
        error: Exception | None = None
        for _ in range(self.config.max_retries):
            peer = await self.next_peer(stage, avoid)
            try:
                return await self.call(stage, peer, tensors)
            except StageCallError as e:
                if not retriable(e):
                    raise
                logger.info(f"Stage {stage}: {e}; trying another peer")
                avoid.add(peer)
                error = e
        raise error

    async def next_peer(self, stage: int, avoid: set[str]) -> str:
        """A peer of `stage` to call, reading the records again if every one known is in `avoid`."""
        peer = self.pick(stage, avoid)
        if peer is None:
            await self.wait_for_swarm()
            peer = self.pick(stage, avoid) or self.pick(stage, set())  # all failed once: any, again
        return peer


def retriable(error: StageCallError) -> bool:
    """Whether another peer (or the same one, after a replay) may answer where this call failed."""
    return error.retriable or error.code in (ErrorCode.SESSION_LOST, ErrorCode.STALE, ErrorCode.OUT_OF_SYNC)
