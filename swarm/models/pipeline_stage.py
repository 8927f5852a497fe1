"""What a pipeline stage of every model family shares: where it sits in the pipeline, and how it runs.

A stage runs in three parts: `enter` turns its input into the residual stream and the context its blocks
share (a GPT subspace model's fixed stream, a Llama's rotary tables), each of `blocks` is called as
block(hidden, context), and `leave` makes what the stage returns. A runtime may so run the blocks a group
at a time (spilling a stage larger than its device, `swarm.peer.stage_spilling`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swarm.models.kv_cache import StageCache
from swarm.models.registry import ModelSpec


class PipelineStage(nn.Module):
    """One stage of a model cut into `num_stages`; subclasses build `blocks` and define `enter` and `leave`."""

    takes_tokens = False  # whether a call carries the token ids beside the hidden states (stages after the first)
    blocks: nn.ModuleList

    def __init__(self, spec: ModelSpec, stage: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is out of range for {num_stages} stages")
        self.spec, self.stage, self.num_stages = spec, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1

    @property
    def num_inputs(self) -> int:
        """How many tensors a forward call carries: the stage's input, and the token ids if it takes them."""
        return 2 if self.takes_tokens else 1

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        cache: StageCache | None = None,
    ) -> torch.Tensor:
        """Runs the stage: its input (token ids on stage 0, hidden states elsewhere), the targets on the last
        stage (then each sample's loss is returned), and the token ids where it takes them. With an inference
        session's `cache`, x holds the positions after the cached ones, and the cache takes theirs."""
        hidden, context = self.enter(x, tokens, cache.length) if cache is not None else self.enter(x, tokens)
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, context) if cache is None else block(hidden, context, cache.layers[index])
        if cache is not None:
            cache.length += x.shape[1]
        return self.leave(hidden, targets, context)

    def enter(self, x: torch.Tensor, tokens: torch.Tensor | None = None, start: int = 0) -> tuple[torch.Tensor, Any]:
        """The stage's input as the residual stream its blocks take, and the context they share; its positions
        begin at `start` (an inference session's cached ones come before)."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's next-token logits [batch, seq, vocab] from what `leave` returns without targets."""
        raise NotImplementedError

    def leave(self, x: torch.Tensor, targets: torch.Tensor | None, context: Any) -> torch.Tensor:
        """What the stage returns from its blocks' output."""
        raise NotImplementedError
