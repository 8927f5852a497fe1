"""Generation and scoring in one process, from the same stages: what the swarm's answers are checked against.

The stages run in order with the same KV caches and sampling the swarm's peers and clients use, so, with the
same weights, the same prompt and no compression, `swarm generate` must give the same tokens (greedy).
"""

from __future__ import annotations

import torch

from swarm.inference.generation import next_token
from swarm.models.kv_cache import StageCache
from swarm.models.pipeline_stage import PipelineStage


@torch.inference_mode()
def _through(stages: list[PipelineStage], tokens: torch.Tensor, caches: list[StageCache] | None = None, targets=None):
    hidden = tokens
    for index, stage in enumerate(stages):
        cache = caches[index] if caches is not None else None
        kwargs = {"cache": cache} if cache is not None else {}
        hidden = stage(
            hidden, targets if stage.is_last else None, tokens=tokens if stage.takes_tokens else None, **kwargs
        )
    return hidden


@torch.inference_mode()
def generate_locally(
    stages: list[PipelineStage],
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """The tokens one process generates continuing `prompt` with `stages` (see `swarm.inference.generation`)."""
    caches = [StageCache(len(stage.blocks)) for stage in stages]
    generator = torch.Generator().manual_seed(seed)
    new: list[int] = []
    feed = torch.tensor([prompt], dtype=torch.int64)
    for _ in range(max_new_tokens):
        hidden = _through(stages, feed, caches)
        token = next_token(stages[-1].logits(hidden[:, -1])[0], temperature, top_k, generator)
        new.append(token)
        feed = torch.tensor([[token]], dtype=torch.int64)
    return new


def losses_locally(stages: list[PipelineStage], windows: torch.Tensor) -> torch.Tensor:
    """Each sample's loss for int64 [batch, seq_len + 1] windows, as `swarm eval` computes them through a swarm."""
    return _through(stages, windows[:, :-1], targets=windows[:, 1:])
