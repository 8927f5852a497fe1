"""Benchmark the wire codecs on activation-like and gradient-like tensors; prints one JSON object to stdout.

For each codec and tensor: bytes on the wire relative to float32, relative L2 and max absolute error, and
encode and decode throughput in MB/s of the float32 input, also as a ratio to a plain `tensor.clone()` of
the same tensor timed in the same run (so that ratios compare across machines better than MB/s do).
Every timing is the median of several repetitions. Progress goes to stderr.

    python scripts/bench_compression.py            # about 10-30 s on 2 CPU cores
    python scripts/bench_compression.py --quick    # small tensors only, a few seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.compression import CODECS, Codec

SMALL_SHAPES = {"activation": [(8, 64, 128)], "gradient": [(128, 128), (768, 768)]}
LARGE_SHAPES = {"activation": [(32, 512, 768)], "gradient": [(768, 3072)]}
MIN_SAMPLE_S = 0.005  # small tensors: time batches of calls, not single sub-millisecond calls


@dataclass
class Sample:
    """One benchmark input: a float32 tensor and what it stands for."""

    name: str
    kind: str
    tensor: torch.Tensor


def gelu_activations(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """GELU outputs of pre-activations with a few high-variance channels, as in a transformer's MLP."""
    pre = torch.randn(shape, generator=generator)
    pre[..., : max(1, shape[-1] // 64)] *= 6.0
    return torch.nn.functional.gelu(pre)


def layernorm_hidden(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Layernormed hidden states with a few outlier channels and rare isolated spikes."""
    hidden = torch.nn.functional.layer_norm(torch.randn(shape, generator=generator), shape[-1:])
    hidden[..., : max(1, shape[-1] // 128)] *= 20.0  # outlier features of trained transformers
    flat = hidden.view(-1)
    spikes = torch.randint(0, flat.numel(), (max(1, flat.numel() // 10_000),), generator=generator)
    flat[spikes] *= 50.0
    return hidden


def heavy_tailed_gradient(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Small-magnitude gradients with heavy tails: student-t (3 degrees of freedom) times 1e-4."""
    z = torch.randn(shape, generator=generator)
    chi2 = sum(torch.randn(shape, generator=generator).square() for _ in range(3))
    return z / (chi2 / 3).sqrt() * 1e-4


def make_samples(quick: bool, seed: int) -> list[Sample]:
    """The benchmark inputs, generated deterministically from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {kind: SMALL_SHAPES[kind] + ([] if quick else LARGE_SHAPES[kind]) for kind in SMALL_SHAPES}
    samples = []
    for shape in shapes["activation"]:
        samples.append(Sample("gelu", "activation", gelu_activations(shape, generator)))
        samples.append(Sample("layernorm_outliers", "activation", layernorm_hidden(shape, generator)))
    for shape in shapes["gradient"]:
        samples.append(Sample("student_t3_grad", "gradient", heavy_tailed_gradient(shape, generator)))
    return samples


def calls_per_sample(fn: Callable[[], object], sync: Callable[[], None], min_sample_s: float) -> int:
    """How many calls of `fn` (after a warm-up call) make one timing sample last at least min_sample_s."""
    fn()  # warm-up: lazy tables, allocator
    sync()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_sample_s:
        fn()
        calls += 1
        sync()
    return calls


def median_seconds(fns: dict[str, Callable[[], object]], reps: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds a call of each function. The functions take turns within each repetition, so that
    a change in the machine's load (other processes) affects them all alike and their ratios less."""
    batches = {key: calls_per_sample(fn, sync, MIN_SAMPLE_S) for key, fn in fns.items()}
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            start = time.perf_counter()
            for _ in range(batches[key]):
                fn()
            sync()
            times[key].append((time.perf_counter() - start) / batches[key])
    return {key: statistics.median(values) for key, values in times.items()}


def bench_codec(codec: Codec, x: torch.Tensor, reps: int, sync: Callable[[], None]) -> dict:
    """Size, error and speed of one codec on one tensor, with the speed of x.clone() beside it."""
    payload = codec.encode(x)
    y = codec.decode(payload, tuple(x.shape), x.dtype)
    x64, y64 = x.detach().cpu().double(), y.double()
    megabytes = x.numel() * 4 / 1e6  # float32 input size
    seconds = median_seconds(
        {
            "clone": x.clone,
            "encode": lambda: codec.encode(x),
            "decode": lambda: codec.decode(payload, tuple(x.shape), x.dtype),
        },
        reps,
        sync,
    )
    clone_mbps = megabytes / seconds["clone"]
    return {
        "codec": codec.name,
        "bytes_ratio": round(len(payload) / (x.numel() * 4), 5),
        "rel_l2_error": float(f"{float((x64 - y64).norm() / x64.norm()):.4g}"),
        "max_abs_error": float(f"{float((x64 - y64).abs().max()):.4g}"),
        "encode_MBps": round(megabytes / seconds["encode"], 1),
        "decode_MBps": round(megabytes / seconds["decode"], 1),
        "clone_MBps": round(clone_mbps, 1),
        "encode_vs_clone": round(megabytes / seconds["encode"] / clone_mbps, 4),
        "decode_vs_clone": round(megabytes / seconds["decode"] / clone_mbps, 4),
    }


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark and prints its JSON report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small tensors and fewer repetitions")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7, 3 with --quick)")
    parser.add_argument("--codecs", nargs="+", default=sorted(CODECS), choices=sorted(CODECS))
    parser.add_argument("--device", default="cpu", help="where the input lives: cpu or cuda (decode is on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 7)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    began = time.perf_counter()
    results = []
    for sample in make_samples(args.quick, args.seed):
        x = sample.tensor.to(device)
        info = {"tensor": sample.name, "kind": sample.kind, "shape": list(x.shape), "absmax": float(x.abs().max())}
        print(f"{sample.name} {list(x.shape)}", file=sys.stderr)
        for name in args.codecs:
            row = bench_codec(CODECS[name], x, reps, sync)
            results.append({**info, **row})
            print(f"  {row}", file=sys.stderr)

    report = {
        "config": {
            "quick": args.quick,
            "threads": torch.get_num_threads(),
            "reps": reps,
            "device": str(device),
            "torch": torch.__version__,
            "seed": args.seed,
            "block_size": 64,
        },
        "results": results,
        "seconds": round(time.perf_counter() - began, 1),
    }
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
