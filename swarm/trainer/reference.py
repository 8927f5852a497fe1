"""The same training in one process: the yardstick for the swarm's fidelity and speed.

It builds every stage from the same spec and seed as the peers (or from the same --hf-checkpoint),
draws the same batches, cuts them into the same microbatches and applies the same accumulation
rule, so a swarm without compression must end with the same parameters, up to floating-point reordering.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from swarm.models import ModelSpec, Stage, initial_stage
from swarm.models.optimizer import OptimizerSettings, apply_accumulated_step, build_optimizer
from swarm.trainer.data import ByteCorpus


@dataclass
class ReferenceRun:
    stages: list[Stage]
    losses: list[float]
    seconds: float
    samples: int


def train_reference(
    spec: ModelSpec,
    num_stages: int,
    corpus: ByteCorpus,
    steps: int,
    target_batch_size: int,
    microbatch_size: int,
    settings: OptimizerSettings,
    seed: int = 0,
    hf_checkpoint: str | None = None,
) -> ReferenceRun:
    """Trains the stages in order, in this process, with the swarm's batches and step rule."""
    stages = [initial_stage(spec, k, num_stages, seed, hf_checkpoint) for k in range(num_stages)]
    optimizers = [build_optimizer(stage, settings) for stage in stages]
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        batch = corpus.batch(step, target_batch_size, spec.seq_len, seed)
        total = 0.0
        for tokens in batch.split(microbatch_size):
            inputs = hidden = tokens[:, :-1]
            for stage in stages[:-1]:
                hidden = stage(hidden, tokens=inputs)
            sample_losses = stages[-1](hidden, tokens[:, 1:], tokens=inputs)
            sample_losses.sum().backward()
            total += float(sample_losses.detach().sum())
        for stage, optimizer in zip(stages, optimizers):
            apply_accumulated_step(stage, optimizer, target_batch_size)
        losses.append(total / target_batch_size)
    return ReferenceRun(stages, losses, time.perf_counter() - start, steps * target_batch_size)


def max_parameter_difference(a: torch.nn.Module, b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between a module's parameters and a state dict."""
    return max(float((t.detach() - b[name]).abs().max()) for name, t in a.state_dict().items())
