"""The held-out loss of the model as the swarm holds it now: batches of held-out text through every stage.

Each batch goes through the stages as forward-only INFER calls (no session), the last stage given the
targets, which answers each sample's loss. The peers run them below their training work, so a trainer
sharing the swarm keeps its pace; the steps the replies came from are reported with the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from swarm.inference.stage_client import StageClient
from swarm.models.registry import ModelSpec


@dataclass
class EvalRecord:
    """What an evaluation measured."""

    samples: int = 0
    loss: float = math.nan  # mean over the samples of each one's mean token loss
    perplexity: float = math.nan
    steps: list[int] = field(default_factory=list)  # per batch, the last stage's step


async def evaluate_batch(client: StageClient, spec: ModelSpec, windows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each sample's loss for int64 [batch, seq_len + 1] windows (inputs, then next tokens), and the last step."""
    tokens, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    hidden = tokens
    num_stages = client.config.num_stages
    for stage in range(num_stages):
        inputs = [hidden] + ([tokens] if stage > 0 and spec.later_stages_take_tokens else [])
        if stage == num_stages - 1:
            inputs.append(targets)
        reply, outputs = await client.call_any(stage, inputs)
        hidden = outputs[0]
    return hidden, reply.step


def summarize(losses: list[torch.Tensor], steps: list[int]) -> EvalRecord:
    """The record of per-sample losses gathered over the batches."""
    every = torch.cat(losses) if losses else torch.zeros(0)
    loss = float(every.mean()) if every.numel() else math.nan
    return EvalRecord(int(every.numel()), loss, math.exp(loss) if every.numel() else math.nan, steps)
