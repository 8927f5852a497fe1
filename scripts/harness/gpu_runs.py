"""The CUDA half of `scripts/bench_gpu.py`: the one-process reference in each dtype, a swarm sharing the GPU,
and a stage spilled under a memory cap. Each part reports an `error` instead of its figures if it fails, so
one failure does not lose the others' figures."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
import traceback

import torch

from swarm.launch.local_swarm import LocalSwarm
from swarm.models import get_model_spec
from swarm.models.optimizer import OptimizerSettings
from swarm.trainer.data import ByteCorpus
from swarm.trainer.reference import train_reference

# dense peak FLOP/s by dtype of the chips we run on (vendor figures, without sparsity)
PEAK_FLOPS = {
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def flops_per_token(spec, num_stages: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward) plus attention's 12 x layers x seq x width."""
    return 6 * spec.num_parameters(num_stages) + 12 * spec.n_layer * spec.seq_len * spec.d_model


def _peak(dtype: str, device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(0)
    return next((peaks[dtype] for chip, peaks in PEAK_FLOPS.items() if chip in name), None)


def reference_speed(args: argparse.Namespace) -> dict:
    """Samples/s, TFLOP/s and MFU of one process training all stages on the GPU, in each dtype."""
    spec = get_model_spec(args.model)
    out = {}
    for name, dtype, compiled in [
        *((name, dtype, False) for name, dtype in DTYPES.items()),
        ("bf16", DTYPES["bf16"], True),
    ]:

        def train(steps: int, dtype: torch.dtype = dtype, compiled: bool = compiled):
            return train_reference(
                spec,
                args.num_stages,
                ByteCorpus(),
                steps,
                args.target_batch_size,
                args.microbatch_size,
                OptimizerSettings(),
                dtype=dtype,
                device=args.device,
                compile=compiled,
            )

        train(1)  # untimed: kernels, libraries and the compiler warm up
        run = train(args.steps)
        rate = run.samples / run.seconds
        flops = rate * spec.seq_len * flops_per_token(spec, args.num_stages)
        peak = _peak(name, args.device)
        out[f"{name}_compiled" if compiled else name] = {
            "samples_per_s": round(rate, 2),
            "tflops": round(flops / 1e12, 1),
            "mfu": round(flops / peak, 3) if peak else None,
            "final_loss": round(run.losses[-1], 4),
        }
        del run
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


class GpuSampler:
    """nvidia-smi's utilization of GPU 0, sampled every 0.5 s with the time of each sample."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        query = ["--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "500", "-i", "0"]
        command = ["nvidia-smi", *query]
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            if line.strip().isdigit():
                self.samples.append((time.monotonic(), float(line)))

    def busy_between(self, start: float, end: float) -> float | None:
        window = [value for at, value in self.samples if start <= at <= end]
        return round(sum(window) / len(window) / 100, 3) if window else None

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(10)


def swarm_speed(args: argparse.Namespace, reference_rate: float | None) -> dict:
    """A local swarm of one peer per stage, all on GPU 0, in bf16: samples/s, against the reference, and busy."""
    model = ["--model", args.model, "--num-stages", str(args.num_stages)]
    workdir = tempfile.mkdtemp(prefix="bench-gpu-")
    summary_file = os.path.join(workdir, "summary.json")
    # a peer on a GPU machine has the host's cores to itself, not one thread as on the 2-core test machines
    threads = str(max(1, (os.cpu_count() or 1) // (args.num_stages + 1)))
    sampler = GpuSampler() if args.device.startswith("cuda") else None
    try:
        with LocalSwarm(workdir, env={"OMP_NUM_THREADS": threads}) as swarm:
            swarm.start_bootstrap()
            peer = [
                *model,
                "--device",
                args.device,
                "--dtype",
                "bf16",
                "--target-batch-size",
                str(args.target_batch_size),
            ]
            for stage in range(args.num_stages):
                swarm.start_peer(f"peer{stage}", stage, peer)
            trainer_flags = [*model, "--steps", str(args.steps), "--microbatch-size", str(args.microbatch_size)]
            trainer_flags += ["--max-in-flight", str(args.max_in_flight), "--compression", "none", "--dtype", "bf16"]
            trainer_flags += ["--summary-file", summary_file, "--no-progress"]
            trainer = swarm.start_trainer("trainer", trainer_flags)
            if trainer.wait() != 0:
                return {"error": f"the trainer failed; logs in {workdir}"}
            ended = time.monotonic()
        with open(summary_file) as file:
            summary = json.load(file)
    finally:
        if sampler is not None:
            sampler.stop()
    rate = summary["samples_per_second"]
    return {
        "samples_per_s": round(rate, 2),
        "ratio_to_reference_bf16": round(rate / reference_rate, 3) if reference_rate else None,
        "gpu_busy": sampler.busy_between(ended - summary["seconds"], ended) if sampler is not None else None,
        "final_loss": summary.get("last_loss"),
    }


def spilling(args: argparse.Namespace) -> dict:
    """One stage in memory, then offloaded under a cap of a quarter of its parameters' bytes: speed, exactness.

    Samples of 256 tokens, so that the activations of a merged batch fit under the cap beside two groups; the
    math attention kernel, whose backward is deterministic (fused ones need not be), so that the fingerprints
    of the two runs can be compared bit for bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harness.stage_training_speed import stage_training_speed

    spec = get_model_spec(args.spill_model)
    cuda = args.device.startswith("cuda")
    options = {"device": args.device, "microbatch": 4, "microbatches": 4, "steps": 3, "seq_len": min(256, spec.seq_len)}
    with sdpa_kernel(SDPBackend.MATH):
        in_memory = stage_training_speed(spec, **options)
        cap = in_memory["stage_bytes"] // 4 if cuda else None
        spilled = stage_training_speed(spec, offload=True, memory_cap_bytes=cap, **options)
    return {
        "model": spec.name,
        "seq_len": options["seq_len"],
        "stage_mb": round(in_memory["stage_bytes"] / 2**20, 1),
        "memory_cap_mb": round(cap / 2**20, 1) if cap else None,
        "peak_memory_mb": round((spilled["peak_memory_bytes"] or 0) / 2**20, 1),
        "groups": spilled["groups"],
        "in_memory_samples_per_s": round(in_memory["samples_per_second"], 2),
        "spilled_samples_per_s": round(spilled["samples_per_second"], 2),
        "ratio": round(spilled["samples_per_second"] / in_memory["samples_per_second"], 3),
        "exact": spilled["fingerprint"] == in_memory["fingerprint"],
    }


def _guarded(part, *args) -> dict:
    try:
        return part(*args)
    except Exception as e:  # one part's failure is reported, the others still run
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


def gpu_runs(args: argparse.Namespace) -> dict:
    """Every CUDA part of the benchmark, each guarded."""
    reference = _guarded(reference_speed, args)
    rate = reference.get("bf16", {}).get("samples_per_s")
    return {
        "reference": reference,
        "swarm": _guarded(swarm_speed, args, rate),
        "spilling": _guarded(spilling, args),
    }
