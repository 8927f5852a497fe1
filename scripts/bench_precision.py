"""bfloat16 against float32 at equal steps, in the one-process reference; prints one JSON object.

For each seed (the model's initialization and the data order) the one-process reference
(`swarm.trainer.reference`) trains the same steps on the same batches three times: in float32; in
bfloat16 as a bf16 swarm computes (autocast, boundaries cast to bfloat16, float32 master weights and
optimizer state); and in float32 again with microbatches half as large, the same training up to the
order of floating-point sums. That third run is the yardstick: a small model early in training is
chaotic, so any rounding difference, a reordering's included, moves its loss by a few percent, and a
difference bfloat16 makes can only be read against it.

The final loss of a run is the mean of its last `--window` steps' losses. Reported per seed: each
run's final loss and its relative difference from float32's, (run - fp32) / fp32; over the seeds: the
relative difference of the mean final losses (the figure held to 2%), the largest per-seed difference
of bfloat16 and of the reordering, and the seed-to-seed spread (standard deviation) of each run's
final loss. On a CUDA device (`--device`) the runs measure the GPU's bfloat16; on a CPU, its autocast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from swarm.models import get_model_spec
from swarm.models.optimizer import OptimizerSettings
from swarm.trainer.data import ByteCorpus
from swarm.trainer.reference import train_reference

# run name: (compute dtype, microbatch size as a share of --microbatch-size)
RUNS = {"fp32": (torch.float32, 1), "bf16": (torch.bfloat16, 1), "fp32_reordered": (torch.float32, 2)}


def final_loss(losses: list[float], window: int) -> float:
    return statistics.fmean(losses[-window:])


def run_seed(seed: int, corpus: ByteCorpus, args: argparse.Namespace) -> dict:
    """The three runs of one seed: their final losses, relative differences from float32's and times."""
    spec = get_model_spec(args.model)
    result: dict = {"seed": seed}
    for name, (dtype, divide) in RUNS.items():
        run = train_reference(
            spec,
            args.num_stages,
            corpus,
            args.steps,
            args.target_batch_size,
            max(1, args.microbatch_size // divide),
            OptimizerSettings(lr=args.lr),
            seed=seed,
            dtype=dtype,
            device=args.device,
        )
        result[name] = {
            "first_loss": round(run.losses[0], 4),
            "final_loss": round(final_loss(run.losses, args.window), 4),
            "seconds": round(run.seconds, 1),
        }
    fp32 = result["fp32"]["final_loss"]
    for name in ("bf16", "fp32_reordered"):
        result[name]["relative_difference"] = round((result[name]["final_loss"] - fp32) / fp32, 5)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--num-stages", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--target-batch-size", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=10, help="final loss: the mean of the last this many steps")
    parser.add_argument("--max-corpus-mb", type=float, default=8.0, help="read this much of the default corpus")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    corpus = ByteCorpus(max_bytes=int(args.max_corpus_mb * 2**20))  # the standard library's source, as bytes
    seeds = [run_seed(seed, corpus, args) for seed in args.seeds]
    means = {name: statistics.fmean(s[name]["final_loss"] for s in seeds) for name in RUNS}
    difference = (means["bf16"] - means["fp32"]) / means["fp32"]
    summary = {
        "model": args.model,
        "device": args.device,
        "steps": args.steps,
        "target_batch_size": args.target_batch_size,
        "microbatch_size": args.microbatch_size,
        "lr": args.lr,
        "final_loss_window": args.window,
        "seeds": seeds,
        "bf16_relative_difference_of_means": round(difference, 5),
        "within_2_percent": abs(difference) <= 0.02,
        "bf16_max_abs_relative_difference": max(abs(s["bf16"]["relative_difference"]) for s in seeds),
        "reordering_max_abs_relative_difference": max(abs(s["fp32_reordered"]["relative_difference"]) for s in seeds),
    }
    for name in RUNS:
        finals = [s[name]["final_loss"] for s in seeds]
        summary[f"{name}_final_loss_mean"] = round(means[name], 4)
        summary[f"{name}_final_loss_spread"] = round(statistics.stdev(finals), 4) if len(finals) > 1 else 0.0
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
