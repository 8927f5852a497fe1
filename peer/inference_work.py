"""Inference on a training peer: forward-only work from the live weights, run in the gaps training leaves.

A request (a held-out batch to score, a generation session's prompt or next token) becomes a job in the
runtime queue's background lane (`swarm.peer.request_queue`): the runtime thread runs it a chunk at a time,
and only while no training request waits. A chunk is sized from the stage's measured speed to take about
`chunk_seconds`, so a training request that arrives meanwhile waits at most that long. Chunks cut a batch
by samples; a session's positions are cut along the sequence, each chunk extending its KV cache.

Inference runs under `torch.inference_mode`: it never touches the gradient accumulators, the step or the
ledger. Its result says the step of the weights that made it (the last chunk's, where a step fell between).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from swarm.models.kv_cache import StageCache
from swarm.models.precision import autocast
from swarm.peer.request_queue import fail, settle
from swarm.peer.runtime import StageRuntime

logger = logging.getLogger(__name__)

FORWARD_SHARE = 1 / 3  # a forward's cost against a backward's (which recomputes the forward), as the runtime's
DEFAULT_CHUNK_SECONDS = 0.02


@dataclass
class InferenceResult:
    """What an inference request gets back: the stage's outputs, and the step of the weights that made them."""

    output: torch.Tensor  # hidden states; on the last stage per-sample losses (targets given) or next-token logits
    step: int


@dataclass(eq=False)
class InferenceJob:
    """One inference request, run a chunk at a time (see the module's docstring)."""

    work: InferenceWork
    inputs: list[torch.Tensor]  # the stage's input, and the token ids where it takes them
    targets: torch.Tensor | None = None  # last stage only: score the samples instead of predicting
    cache: StageCache | None = None  # a generation session's: positions go along the sequence
    give_up_at: float | None = None
    future: Future = field(default_factory=Future)
    done: int = 0  # samples (no cache) or positions (cache) run so far
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.inputs[0].shape[1 if self.cache is not None else 0]

    def late(self, now: float) -> bool:
        return self.give_up_at is not None and self.give_up_at <= now

    def run_chunk(self) -> bool:
        """Runs the next chunk; True once the job is done (its future then settled, or failed)."""
        try:
            return self.work.run_chunk(self)
        except Exception as e:
            logger.exception(f"Stage {self.work.runtime.module.stage}: an inference request failed")
            fail(self.future, e)
            return True


class InferenceWork:
    """Runs a stage's inference requests in the runtime's background lane, chunk by chunk."""

    def __init__(self, runtime: StageRuntime, chunk_seconds: float = DEFAULT_CHUNK_SECONDS) -> None:
        self.runtime = runtime
        self.chunk_seconds = chunk_seconds
        self.busy_seconds = 0.0  # spent running inference chunks
        self.samples = 0  # samples (or, in sessions, whole sequences' worth of positions) served
        self.chunks = 0

    def submit(
        self,
        inputs: list[torch.Tensor],
        targets: torch.Tensor | None = None,
        cache: StageCache | None = None,
        give_up_at: float | None = None,
    ) -> Future:
        """Queues an inference request; the future resolves to an InferenceResult (QueueFullError if full)."""
        job = InferenceJob(self, inputs, targets, cache, give_up_at)
        self.runtime.requests.put_background(job)
        return job.future

    def chunk_size(self, positions: bool) -> int:
        """Samples (or, with `positions`, sequence positions) in one chunk: about `chunk_seconds` of forward work
        at the stage's measured speed (one sample, or a sixteenth of a sequence, before it is measured)."""
        seq_len = self.runtime.module.spec.seq_len
        per_sample = self.runtime.seconds_per_sample
        if not per_sample:
            return max(1, seq_len // 16) if positions else 1
        per_sample *= FORWARD_SHARE
        if positions:
            return max(1, int(self.chunk_seconds / (per_sample / seq_len)))
        return max(1, int(self.chunk_seconds / per_sample))

    def run_chunk(self, job: InferenceJob) -> bool:
        """Runs `job`'s next chunk on the runtime thread; True once it is done."""
        runtime = self.runtime
        sessions = job.cache is not None
        size = min(self.chunk_size(sessions), job.total - job.done)
        cut = slice(job.done, job.done + size)
        inputs = [t[:, cut] if sessions else t[cut] for t in job.inputs]
        targets = None if job.targets is None else job.targets[cut]
        started = time.perf_counter()
        output = self._forward(inputs, targets, job.cache)
        samples = size / runtime.module.spec.seq_len if sessions else size
        self._pad_to_simulated_speed(started, samples)
        self.busy_seconds += time.perf_counter() - started
        if not sessions:
            self.samples += size
        self.chunks += 1
        job.outputs.append(output)
        job.done += size
        if job.done < job.total:
            return False
        self._finish(job)
        return True

    def _finish(self, job: InferenceJob) -> None:
        module = self.runtime.module
        if job.cache is not None:
            self.samples += job.inputs[0].shape[0]
        if job.cache is None:
            output = torch.cat(job.outputs)
        elif module.is_last:
            output = job.outputs[-1]  # the next token's logits: those of the session's last position
        else:
            output = torch.cat(job.outputs, dim=1)
        settle(job.future, InferenceResult(output, self.runtime.step))

    def _forward(
        self, inputs: list[torch.Tensor], targets: torch.Tensor | None, cache: StageCache | None
    ) -> torch.Tensor:
        """The stage on one chunk, as the runtime runs a forward (its dtype, autocast, spilled blocks), on the host."""
        runtime, module = self.runtime, self.runtime.module
        inputs = runtime.copies.to_device(inputs)
        hidden = inputs[0].float() if inputs[0].is_floating_point() else inputs[0]
        tokens = inputs[1] if module.takes_tokens else None
        if targets is not None:
            targets = targets.to(runtime.device)
        with torch.inference_mode(), autocast(runtime.device, runtime.dtype):
            if cache is None:
                output = (runtime.spilling or module)(hidden, targets, tokens=tokens)
            else:
                output = module(hidden, targets, tokens=tokens, cache=cache)
            if module.is_last and targets is None:
                output = module.logits(output[:, -1])
        last = module.is_last
        return (output.float() if last else output.to(runtime.dtype)).cpu()

    def _pad_to_simulated_speed(self, started: float, samples: float) -> None:
        """With a simulated device, sleeps until the chunk took as long as that device's forward would."""
        speed = self.runtime.simulated_speed
        if speed <= 0:
            return
        remaining = started + samples / speed * FORWARD_SHARE - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
