"""Generation through the swarm: a session through one peer per stage, each keeping its stage's KV cache.

The prompt goes through the stages once; then each new token goes through them alone, every peer
extending its cache (`swarm.peer.inference_sessions`). The session keeps what it sent each stage, so when
a peer dies, or drops the session, the stage moves to another of its peers and the prefix is replayed
there: a replay, not a lost answer. Every reply says the step of the weights that made it.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import torch

from swarm.inference.stage_client import StageClient, retriable
from swarm.models.registry import ModelSpec
from swarm.net.transport import StageCallError
from swarm.proto import ErrorCode

logger = logging.getLogger(__name__)


@dataclass
class GenerationRecord:
    """What a generation produced and what it took."""

    tokens: list[int] = field(default_factory=list)  # the new tokens
    steps: list[int] = field(default_factory=list)  # per new token, the last stage's step that predicted it
    replays: int = 0  # times a stage's prefix was sent again (its peer died, or dropped the session)
    calls: int = 0


class GenerationSession:
    """One sequence's generation through the swarm (see the module's docstring)."""

    def __init__(self, client: StageClient, spec: ModelSpec, num_stages: int) -> None:
        self.client = client
        self.spec = spec
        self.num_stages = num_stages
        self.name = secrets.token_hex(8)
        self.peers: dict[int, str] = {}  # the peer of each stage that holds this session's cache
        self.sent: dict[int, list[list[torch.Tensor]]] = {s: [] for s in range(num_stages)}  # what each stage got
        self.record = GenerationRecord()

    @property
    def length(self) -> int:
        """Positions the session holds."""
        return sum(chunk[0].shape[1] for chunk in self.sent[0])

    async def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sends new positions (int64 [1, n]) through every stage; the next token's logits [vocab] (float32)."""
        hidden = tokens
        for stage in range(self.num_stages):
            inputs = [hidden] + ([tokens] if stage > 0 and self.spec.later_stages_take_tokens else [])
            hidden = await self._call(stage, inputs)
        return hidden[0]

    async def _call(self, stage: int, inputs: list[torch.Tensor]) -> torch.Tensor:
        """`inputs` through `stage`'s peer of this session, moved to another peer (and the prefix replayed) if
        it fails; the new positions' outputs."""
        avoid: set[str] = set()
        error: StageCallError | None = None
        new = inputs[0].shape[1]
        for _ in range(self.client.config.max_retries):
            peer = self.peers.get(stage)
            replay = peer is None and bool(self.sent[stage])
            if peer is None:
                peer = await self.client.next_peer(stage, avoid)
            sent = [torch.cat(column, dim=1) for column in zip(*self.sent[stage], inputs)] if replay else inputs
            position = 0 if peer != self.peers.get(stage) else self._position(stage)
            try:
                reply, outputs = await self.client.call(stage, peer, sent, self.name, position)
            except StageCallError as e:
                if not retriable(e):
                    raise
                error = e
                self.peers.pop(stage, None)
                if e.code != ErrorCode.SESSION_LOST:  # a peer that lost the session alone may take its replay
                    avoid.add(peer)
                logger.info(f"Stage {stage}: {e}; moving the session to another peer and replaying its prefix")
                continue
            self.record.calls += 1
            self.record.replays += replay
            self.peers[stage] = peer
            self.sent[stage].append(inputs)
            if stage == self.num_stages - 1:
                self.record.steps.append(reply.step)
                return outputs[0]
            return outputs[0][:, -new:]  # after a replay, the next stage (which holds its own cache) takes the new ones
        raise error

    def _position(self, stage: int) -> int:
        return sum(chunk[0].shape[1] for chunk in self.sent[stage])

    async def close(self) -> None:
        """Asks every peer that holds the session to drop its cache (a peer that does not answer drops it idle)."""
        for stage, peer in self.peers.items():
            try:
                await self.client.call(stage, peer, [], self.name, end=True)
            except StageCallError as e:
                logger.debug(f"Stage {stage}: could not end session {self.name}: {e}")
        self.peers.clear()


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """The likeliest token (temperature 0), or one sampled from the softmax at `temperature` over the top k."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = torch.where(scaled < kth, torch.full_like(scaled, float("-inf")), scaled)
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))


async def generate(
    session: GenerationSession,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    on_token=None,
) -> GenerationRecord:
    """Continues `prompt` by `max_new_tokens` tokens through the swarm; `on_token(token)` is told each one."""
    if not prompt:
        raise ValueError("the prompt holds no token")
    if len(prompt) + max_new_tokens > session.spec.seq_len + 1:
        raise ValueError(
            f"{len(prompt)} prompt tokens and {max_new_tokens} new ones exceed the model's context of "
            f"{session.spec.seq_len} (the last new token is not fed back)"
        )
    generator = torch.Generator().manual_seed(seed)
    logits = await session.extend(torch.tensor([prompt], dtype=torch.int64))
    for index in range(max_new_tokens):
        token = next_token(logits, temperature, top_k, generator)
        session.record.tokens.append(token)
        if on_token is not None:
            on_token(token)
        if index + 1 < max_new_tokens:
            logits = await session.extend(torch.tensor([[token]], dtype=torch.int64))
    return session.record
