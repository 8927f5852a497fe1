"""Convergence with compressed activations and gradients; prints one JSON object.

For each run a fresh local swarm (a bootstrap node, one peer per stage) trains the same steps on the
same data, with the trainer's `--compression` set to the run's codec: activations and gradients are
compressed both ways. A run is a codec ("8bit") or a model and a codec ("gpt-tiny-bottleneck:8bit",
a learned projection at every stage boundary, then 8 bits a value). Each run is repeated per `--seeds`
(the model's initialization), so the run-to-run spread is known. Reported per run: the loss curve of
the first seed (mean per window of steps), the final loss per seed (mean of the last window), their
mean and its relative difference from the mean of the plain `none` run, and the bytes per sample the
trainer sent and received, and how many times fewer that is than `none` (float32 on the wire).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from swarm.launch.local_swarm import LocalSwarm


def train(run: str, seed: int, args: argparse.Namespace, workdir: Path) -> dict:
    model, _, codec = run.rpartition(":")
    model_flags = ["--model", model or args.model, "--num-stages", "3", "--seed", str(seed)]
    name = f"{run.replace(':', '-')}-seed{seed}"
    summary_file = workdir / f"{name}.json"
    with LocalSwarm(workdir / name) as swarm:
        swarm.start_bootstrap()
        for stage in range(3):
            swarm.start_peer(f"peer{stage}", stage, [*model_flags, "--target-batch-size", "32", "--lr", str(args.lr)])
        trainer = swarm.start_trainer(
            "trainer",
            [
                *model_flags,
                "--compression",
                codec,
                "--steps",
                str(args.steps),
                "--microbatch-size",
                "8",
                "--max-in-flight",
                "6",
                "--summary-file",
                str(summary_file),
                "--no-progress",
            ],
        )
        if trainer.wait() != 0:
            sys.exit(f"the {run} run (seed {seed}) failed; logs in {workdir / name}")
    return json.loads(summary_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", "--codecs", nargs="+", default=["none", "fp16", "8bit"], help="codecs, or MODEL:CODEC, to compare"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="initialization seeds of each run")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of 32 samples per run")
    parser.add_argument("--window", type=int, default=20, help="steps per point of the reported curves")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--model", default="gpt-tiny", help="model preset of runs that name none")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw every run's loss and samples/s per step there")
    args = parser.parse_args()
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot}: give a .png file")
    workdir = Path(tempfile.mkdtemp(prefix="bench-convergence-"))
    curves, summaries, finals, traffic = {}, {}, {}, {}
    for run in args.runs:
        finals[run] = []
        for seed in args.seeds:
            summary = train(run, seed, args, workdir)
            losses = summary["losses"]
            curve = [
                round(sum(losses[i : i + args.window]) / len(losses[i : i + args.window]), 4)
                for i in range(0, len(losses), args.window)
            ]
            finals[run].append(curve[-1])
            if seed == args.seeds[0]:
                curves[run], summaries[run] = curve, summary
                samples = max(1, summary["samples"])
                traffic[run] = (summary["bytes_sent"] / samples, summary["bytes_received"] / samples)
    mean = {run: round(statistics.mean(values), 4) for run, values in finals.items()}
    baseline = mean.get("none")
    plain = traffic.get("none")
    result = {
        "model": args.model,
        "steps": args.steps,
        "window": args.window,
        "seeds": args.seeds,
        "final_loss": finals,
        "final_loss_mean": mean,
        "final_loss_spread": {run: round(max(v) - min(v), 4) for run, v in finals.items()},
        "relative_to_none": {run: round(v / baseline - 1, 4) for run, v in mean.items()} if baseline else {},
        "bytes_per_sample_sent_received": {run: [round(b) for b in t] for run, t in traffic.items()},
        "times_fewer_bytes_than_none": (
            {run: [round(p / b, 2) for p, b in zip(plain, t)] for run, t in traffic.items()} if plain else {}
        ),
        "curves": curves,
    }
    if args.plot:
        from swarm.ops.plots import PlotError, curves_from_summary, plot_training

        runs = [curves_from_summary(summary, run) for run, summary in summaries.items()]
        try:
            result["plot"] = str(plot_training(runs, args.plot, f"{args.model}: loss and samples/s per codec"))
        except PlotError as e:
            print(f"no plot: {e}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
