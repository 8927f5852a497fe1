"""Inference on a training peer: forward-only work from the live weights, run in the gaps training leaves.

A request (a held-out batch to score, a generation session's prompt or next token) becomes a job in the
runtime queue's background lane (`swarm.peer.request_queue`): the runtime thread runs it a chunk at a time,
and only while no training request waits. A chunk is sized from the stage's measured speed to take about
`chunk_seconds`, so a training request that arrives meanwhile waits at most that long. Chunks cut a batch
by samples; a session's positions, and a sample whose forward alone is longer than a chunk, are cut along the
sequence, each chunk extending a KV cache (the session's, or one the sample keeps until it is whole).

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
    cache: StageCache | None = None  # a generation session's: chunks go along the sequence, every sample at once
    give_up_at: float | None = None
    future: Future = field(default_factory=Future)
    row: int = 0  # samples done (no session)
    position: int = 0  # positions done: of the session, or of sample `row` where a sample is cut along its sequence
    row_cache: StageCache | None = None  # sample `row`'s positions so far, where it is cut along its sequence
    row_parts: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # its chunks' outputs and lengths
    outputs: list[torch.Tensor] = field(default_factory=list)

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
        self.samples = 0  # samples served (a session's calls count their samples once per call)
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

    def _forward_seconds(self) -> float | None:
        """Seconds of one sample's forward at the stage's measured speed (None until it is measured)."""
        per_sample = self.runtime.seconds_per_sample
        return per_sample * FORWARD_SHARE if per_sample else None

    def samples_per_chunk(self) -> int:
        """Whole samples that fit in a chunk: 0 where one sample's forward takes longer (it is then cut along its
        sequence); one before the stage's speed is measured."""
        per_sample = self._forward_seconds()
        rows = int(self.chunk_seconds / per_sample) if per_sample else 1
        # a spilled stage streams its blocks a group at a time and keeps no cache: whole samples only
        return max(rows, 1) if self.runtime.spilling is not None else rows

    def positions_per_chunk(self, samples: int) -> int:
        """Positions of `samples` samples that fit in a chunk (at least one; a sixteenth of a sequence before the
        stage's speed is measured)."""
        seq_len = self.runtime.module.spec.seq_len
        per_sample = self._forward_seconds()
        if not per_sample:
            return max(1, seq_len // 16)
        return max(1, int(self.chunk_seconds / (per_sample * samples / seq_len)))

    def run_chunk(self, job: InferenceJob) -> bool:
        """Runs `job`'s next chunk on the runtime thread; True once it is done."""
        batch, seq = job.inputs[0].shape[:2]
        started = time.perf_counter()
        if job.cache is not None:  # a session: the next positions of every sample
            size = min(self.positions_per_chunk(batch), seq - job.position)
            cut = slice(job.position, job.position + size)
            job.outputs.append(self._forward([t[:, cut] for t in job.inputs], None, job.cache))
            job.position += size
            samples, done = batch * size / seq, job.position >= seq
        elif (rows := self.samples_per_chunk()) >= 1:  # whole samples
            cut = slice(job.row, min(batch, job.row + rows))
            targets = None if job.targets is None else job.targets[cut]
            job.outputs.append(self._forward([t[cut] for t in job.inputs], targets, None))
            samples, job.row = cut.stop - cut.start, cut.stop
            done = job.row >= batch
        else:  # one sample's forward is longer than a chunk: its positions, a chunk at a time
            samples = self._sample_part(job, seq)
            done = job.row >= batch
        self._pad_to_simulated_speed(started, samples)
        self.busy_seconds += time.perf_counter() - started
        self.chunks += 1
        if done:
            self.samples += batch
            self._finish(job)
        return done

    def _sample_part(self, job: InferenceJob, seq: int) -> float:
        """The next positions of sample `job.row`, through a cache of its own; the row's output once it is whole.
        Returns the samples' worth of work done."""
        if job.row_cache is None:
            job.row_cache = StageCache(len(self.runtime.module.blocks))
        size = min(self.positions_per_chunk(1), seq - job.position)
        row, cut = slice(job.row, job.row + 1), slice(job.position, job.position + size)
        targets = None if job.targets is None else job.targets[row, cut]
        job.row_parts.append((self._forward([t[row, cut] for t in job.inputs], targets, job.row_cache), size))
        job.position += size
        if job.position >= seq:
            module, parts = self.runtime.module, job.row_parts
            if module.is_last and job.targets is not None:  # each part's mean loss, weighted by its positions
                job.outputs.append(sum(loss * size for loss, size in parts) / seq)
            elif module.is_last:
                job.outputs.append(parts[-1][0])  # the next token's logits: the last position's
            else:
                job.outputs.append(torch.cat([out for out, _ in parts], dim=1))
            job.row, job.position, job.row_cache, job.row_parts = job.row + 1, 0, None, []
        return size / seq

    def _finish(self, job: InferenceJob) -> None:
        module = self.runtime.module
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
