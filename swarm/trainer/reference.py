"""The same training in one process: the yardstick for the swarm's fidelity and speed.

It builds every stage from the same spec and seed as the peers (or from the same --hf-checkpoint),
draws the same batches, cuts them into the same microbatches and applies the same accumulation
rule, so a swarm without compression must end with the same parameters, up to floating-point reordering.

In a compute dtype other than float32 (`swarm.models.precision`) it computes as the peers do: each
stage under autocast, its output cast to the dtype at the boundary (as it crosses the wire) and taken
up to float32 by the next stage; parameters and optimizer state stay float32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from swarm.models import ModelSpec, Stage, compile_blocks, initial_stage
from swarm.models.optimizer import OptimizerSettings, apply_accumulated_step, build_optimizer
from swarm.models.precision import autocast
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
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    compile: bool = False,
) -> ReferenceRun:
    """Trains the stages in order, in this process, with the swarm's batches and step rule, computing in `dtype`
    on `device` (with `compile`, the blocks compiled as a peer's --compile does)."""
    where = torch.device(device)
    stages = [initial_stage(spec, k, num_stages, seed, hf_checkpoint).to(where) for k in range(num_stages)]
    if compile:
        stages = [compile_blocks(stage) for stage in stages]
    optimizers = [build_optimizer(stage, settings) for stage in stages]
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        batch = corpus.batch(step, target_batch_size, spec.seq_len, seed)
        total = 0.0
        for tokens in batch.to(where).split(microbatch_size):
            inputs = hidden = tokens[:, :-1]
            with autocast(where, dtype):
                for stage in stages[:-1]:
                    hidden = stage(_taken(hidden), tokens=inputs).to(dtype)
                sample_losses = stages[-1](_taken(hidden), tokens[:, 1:], tokens=inputs).float()
            sample_losses.sum().backward()
            total += float(sample_losses.detach().sum())
        for stage, optimizer in zip(stages, optimizers):
            apply_accumulated_step(stage, optimizer, target_batch_size)
        losses.append(total / target_batch_size)
    return ReferenceRun(stages, losses, time.perf_counter() - start, steps * target_batch_size)


def _taken(hidden: torch.Tensor) -> torch.Tensor:
    """A stage's input as a peer takes it: token ids as they are, a boundary tensor up to float32."""
    return hidden.float() if hidden.is_floating_point() else hidden


def max_parameter_difference(a: torch.nn.Module, b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between a module's parameters and a state dict."""
    return max(float((t.detach() - b[name]).abs().max()) for name, t in a.state_dict().items())
