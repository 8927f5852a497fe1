"""One stage trained in this process through its runtime, timed: in memory, or spilled (--offload) under a cap.

For the GPU benchmark's spilling figures: run `stage_training_speed` once in memory and once with offload
(under a memory cap, e.g. a quarter of the in-memory run's `stage_bytes`), then compare samples/s, and the
fingerprints for exactness. Each step's microbatches are queued before the runtime takes them, so they merge
into one batch: one pass of loads serves them all, as on a busy peer.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from swarm.models import build_stage
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.models.registry import ModelSpec
from swarm.peer.runtime import StageRuntime
from swarm.peer.stage_spilling import cuda_index, tensor_bytes


def stage_training_speed(
    spec: ModelSpec,
    device: str = "cuda",
    offload: bool = False,
    offload_group: int = 0,
    memory_cap_bytes: int | None = None,
    stage: int = 0,
    num_stages: int = 1,
    microbatch: int = 8,
    microbatches: int = 2,
    steps: int = 3,
    seq_len: int | None = None,
    seed: int = 0,
    **runtime_options: Any,
) -> dict[str, Any]:
    """Trains `steps` optimizer steps (after one untimed) of `microbatches` microbatches of `microbatch` samples
    on one stage and returns what it measured: samples_per_second, seconds, stage_bytes (the stage's parameters),
    peak_memory_bytes (on CUDA), groups (blocks per group with offload), fingerprint (the parameters at the end:
    equal in and out of memory when the run is exact) and losses (on the last stage).

    `memory_cap_bytes` caps this process's CUDA memory (torch.cuda.set_per_process_memory_fraction) while the
    stage is built and trained; the cap is lifted on return. `runtime_options` go to StageRuntime (e.g. dtype).
    """
    torch_device = torch.device(device)
    cuda = torch_device.type == "cuda"
    if cuda:  # the memory-fraction calls need an index, not a bare "cuda"
        torch_device = torch.device("cuda", cuda_index(torch_device))
    batch = microbatch * microbatches
    length = seq_len or spec.seq_len
    requests = [_request(spec, stage, num_stages, microbatch, length, seed * 1000 + i) for i in range(microbatches)]
    gc.collect()  # a runtime from an earlier call sits in a reference cycle, its device memory with it
    previous_fraction = _cap(torch_device, memory_cap_bytes) if cuda and memory_cap_bytes else None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(torch_device)
        module = build_stage(spec, stage, num_stages, seed)
        stage_bytes = tensor_bytes(iter(module.parameters()))
        runtime = StageRuntime(
            module,
            build_optimizer(module, OptimizerSettings()),
            target_batch_size=batch,
            device=device,
            max_batch_samples=batch,
            max_batch_seconds=0.0,
            offload=offload,
            offload_group=offload_group,
            **runtime_options,
        )
        runtime.start()
        try:
            _train(runtime, requests, 1)  # untimed: kernels, the allocator and the optimizer's state warm up
            if cuda:
                torch.cuda.synchronize(torch_device)
            start = time.perf_counter()
            losses = _train(runtime, requests, steps)
            if cuda:
                torch.cuda.synchronize(torch_device)
            seconds = time.perf_counter() - start
        finally:
            runtime.shutdown()
        peak = torch.cuda.max_memory_allocated(torch_device) if cuda else None
    finally:
        if previous_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(previous_fraction, torch_device)
    return {
        "samples_per_second": steps * batch / seconds,
        "seconds": seconds,
        "stage_bytes": stage_bytes,
        "peak_memory_bytes": peak,
        "memory_cap_bytes": memory_cap_bytes,
        "groups": [len(group) for group in runtime.spilling.groups] if runtime.spilling is not None else None,
        "fingerprint": runtime.fingerprint,
        "losses": losses,
    }


def _cap(device: torch.device, cap_bytes: int) -> float:
    """Caps this process's memory on `device`; returns the fraction that was in force before."""
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = getter(device) if getter is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    return previous


def _train(runtime: StageRuntime, requests: list[list[torch.Tensor]], steps: int) -> list[float]:
    """`steps` steps, each of every request queued at once; returns the mean loss of each step (last stage)."""
    losses = []
    for _ in range(steps):
        step = runtime.step
        results = [future.result(600) for future in [runtime.submit(True, tensors) for tensors in requests]]
        while runtime.step == step:  # the step runs right after the batch that completes it
            time.sleep(0.001)
        if results[0].losses is not None:
            losses.append(float(torch.cat([r.losses for r in results]).mean()))
    return losses


def _request(spec: ModelSpec, stage: int, num_stages: int, batch: int, length: int, seed: int) -> list[torch.Tensor]:
    """A backward request for the stage: its inputs, then its output gradient (or the targets on the last)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (batch, length), generator=g)
    first = tokens if stage == 0 else torch.randn(batch, length, spec.boundary_width, generator=g)
    inputs = [first, tokens] if spec.later_stages_take_tokens and stage > 0 else [first]
    if stage == num_stages - 1:
        return [*inputs, torch.randint(0, spec.vocab_size, (batch, length), generator=g)]
    return [*inputs, torch.randn(batch, length, spec.boundary_width, generator=g) * 1e-3]
