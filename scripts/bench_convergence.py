"""Convergence with compressed activations and gradients; prints one JSON object.

For each codec a fresh local swarm (a bootstrap node, one gpt-tiny peer per stage, the same
seed) trains the same steps on the same data, with the trainer's `--compression` set to that
codec: activations and gradients are compressed both ways. Reported per codec: the loss curve
(mean per window of steps), the final loss (mean of the last window) and its relative
difference from the uncompressed run of the same invocation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from swarm.local_swarm import LocalSwarm


def train(codec: str, args: argparse.Namespace, workdir: Path) -> dict:
    model_flags = ["--model", args.model, "--num-stages", "3", "--seed", "1"]
    summary_file = workdir / f"{codec}.json"
    with LocalSwarm(workdir / codec) as swarm:
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
            sys.exit(f"the {codec} run failed; logs in {workdir / codec}")
    return json.loads(summary_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", nargs="+", default=["none", "fp16", "8bit"], help="codecs to compare")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of 32 samples per run")
    parser.add_argument("--window", type=int, default=20, help="steps per point of the reported curves")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--model", default="gpt-tiny", help="model preset")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw every codec's loss and samples/s per step there")
    args = parser.parse_args()
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot}: give a .png file")
    workdir = Path(tempfile.mkdtemp(prefix="bench-convergence-"))
    curves, summaries = {}, {}
    for codec in args.codecs:
        summaries[codec] = train(codec, args, workdir)
        losses = summaries[codec]["losses"]
        curves[codec] = [
            round(sum(losses[i : i + args.window]) / len(losses[i : i + args.window]), 4)
            for i in range(0, len(losses), args.window)
        ]
    final = {codec: curve[-1] for codec, curve in curves.items()}
    baseline = final.get("none")
    result = {
        "model": args.model,
        "steps": args.steps,
        "window": args.window,
        "final_loss": final,
        "relative_to_none": {c: round(v / baseline - 1, 4) for c, v in final.items()} if baseline else {},
        "curves": curves,
    }
    if args.plot:
        from swarm.plots import PlotError, curves_from_summary, plot_training

        runs = [curves_from_summary(summary, codec) for codec, summary in summaries.items()]
        try:
            result["plot"] = str(plot_training(runs, args.plot, f"{args.model}: loss and samples/s per codec"))
        except PlotError as e:
            print(f"no plot: {e}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
