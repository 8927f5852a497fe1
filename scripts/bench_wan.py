"""Throughput over wide-area links in the link-bound regime, per model and codec; prints one JSON object.

A swarm pays for compression where the link, not the device, sets the pace: GPUs on 100 or 20 Mbit/s
links. This machine's CPU is far slower than such a GPU, so the benchmark scales time instead: with
`--time-scale K` the devices stand for devices K times faster than this machine, and every link is
emulated K times slower with K times its latency (`--emulate-bandwidth-mbit B/K`,
`--emulate-latency-ms L*K` in the trainer's transport; the trainer's own link, which its calls to
every peer share, is capped at B/K as well unless `--uncapped-trainer`). Every duration of the run is then K times
the one the faster devices would see, so samples/s are reported multiplied by K: what the swarm
would do on the named links with those devices. A run with no emulated link per model gives the
devices' own pace (K times this machine's), which shows how far below it the links hold the swarm.

One local swarm (a bootstrap node and one peer per stage) per model serves a trainer per codec and
bandwidth. Reported per run: samples/s, speed-up over `none` of the plain model at the same
bandwidth, and bytes on the wire per sample and how many times fewer than that `none` run, so a
codec's speed-up stands beside its byte ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from swarm.launch.local_swarm import LocalSwarm


def run_name(model: str, codec: str, bandwidth: float | None) -> str:
    """How a run is keyed in the result: MODEL:CODEC@BANDWIDTH (or @no-link)."""
    return f"{model}:{codec}@{'no-link' if bandwidth is None else f'{bandwidth:g}mbit'}"


def trainer_flags(args: argparse.Namespace, codec: str, bandwidth: float | None) -> list[str]:
    """The trainer's flags for one run; the link is scaled by --time-scale (see the module's docstring)."""
    scale = args.time_scale
    flags = [
        "--compression",
        codec,
        "--steps",
        str(args.steps),
        "--microbatch-size",
        str(args.microbatch_size),
        "--in-flight-ceiling",
        str(args.in_flight_ceiling),
        # deadlines in this machine's time: K times those faster devices would need
        "--call-timeout",
        str(60.0 * scale),
        "--call-timeout-floor",
        str(15.0 * scale),
        "--no-progress",
    ]
    if args.overlap_steps:
        flags.append("--overlap-steps")
    if args.max_in_flight is not None:
        flags += ["--max-in-flight", str(args.max_in_flight)]
    if args.uncapped_trainer:
        flags.append("--no-emulate-own-link")
    if bandwidth is not None:
        flags += ["--emulate-bandwidth-mbit", str(bandwidth / scale)]
        flags += ["--emulate-latency-ms", str(args.latency_ms * scale)]
    return flags


def parse_runs() -> tuple[argparse.Namespace, dict[str, list[str]]]:
    """The command line, and the codecs of its --runs per model, in order."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["gpt-tiny:none", "gpt-tiny:8bit", "gpt-tiny-subspace:8bit"],
        help="MODEL:CODEC runs (each model gets its own swarm); MODEL:none of the first model is the baseline",
    )
    parser.add_argument(
        "--bandwidths-mbit", type=float, nargs="+", default=[100.0], help="link bandwidths each way, per peer: 100 20"
    )
    parser.add_argument("--latency-ms", type=float, default=50.0, help="one-way latency of every link")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=20.0,
        help="the devices stand for devices this many times faster than this machine (see the description)",
    )
    parser.add_argument("--num-stages", type=int, default=3, help="pipeline stages (one peer each)")
    parser.add_argument("--steps", type=int, default=2, help="steps per run")
    # steps large enough that the links' latency at each step boundary is a small part of a step
    parser.add_argument("--target-batch-size", type=int, default=1024, help="samples per step")
    parser.add_argument("--microbatch-size", type=int, default=32, help="samples per microbatch")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="a fixed number of microbatches in flight; default: trainers size it from the pipeline's rate and round "
        "trip, up to --in-flight-ceiling",
    )
    parser.add_argument("--in-flight-ceiling", type=int, default=256, help="the most microbatches in flight")
    parser.add_argument(
        "--uncapped-trainer",
        action="store_true",
        help="cap each trainer-to-peer link only, not the trainer's own link (which all its calls share)",
    )
    parser.add_argument(
        "--overlap-steps", action="store_true", help="trainers start each step while the one before finishes"
    )
    args = parser.parse_args()
    if args.time_scale < 1:
        parser.error("--time-scale must be 1 or more")
    runs_by_model: dict[str, list[str]] = {}
    for run in args.runs:
        model, sep, codec = run.partition(":")
        if not sep or not model or not codec:
            parser.error(f"--runs {run}: give MODEL:CODEC, e.g. gpt-tiny:8bit")
        runs_by_model.setdefault(model, []).append(codec)
    return args, runs_by_model


def run_swarms(
    args: argparse.Namespace, runs_by_model: dict[str, list[str]], workdir: Path
) -> tuple[dict[str, dict], dict[str, float | None]]:
    """One local swarm per model, a trainer per codec and bandwidth (and one with no link); returns each run's
    summary and bandwidth, by run name. Exits with the logs' folder if a trainer fails."""
    summaries: dict[str, dict] = {}
    links: dict[str, float | None] = {}  # run -> its bandwidth
    for model, codecs in runs_by_model.items():
        model_flags = ["--model", model, "--num-stages", str(args.num_stages)]
        with LocalSwarm(workdir / model) as swarm:
            swarm.start_bootstrap()
            for stage in range(args.num_stages):
                swarm.start_peer(
                    f"peer{stage}", stage, [*model_flags, "--target-batch-size", str(args.target_batch_size)]
                )
            plan = [(codec, bandwidth) for bandwidth in args.bandwidths_mbit for codec in codecs]
            plan.append((codecs[0], None))
            for codec, bandwidth in plan:
                name = run_name(model, codec, bandwidth)
                summary_file = workdir / f"{name.replace(':', '-').replace('@', '-')}.json"
                trainer = swarm.start_trainer(
                    f"trainer-{len(summaries)}",
                    [*model_flags, *trainer_flags(args, codec, bandwidth), "--summary-file", str(summary_file)],
                )
                if trainer.wait() != 0:
                    sys.exit(f"the {name} trainer failed; logs in {workdir}")
                summaries[name] = json.loads(summary_file.read_text())
                links[name] = bandwidth
    return summaries, links


def bytes_per_sample(summary: dict) -> float:
    """Bytes on the wire, both ways, per sample trained."""
    return (summary["bytes_sent"] + summary["bytes_received"]) / max(1, summary["samples"])


def figures(
    args: argparse.Namespace, summaries: dict[str, dict], links: dict[str, float | None], baseline_model: str
) -> dict[str, dict[str, float]]:
    """Per run: samples/s (over the run and its last step) and wire KB per sample scaled as the module says,
    and the speed-up and byte ratio against the baseline model's `none` run at the same bandwidth."""
    samples_per_s, speedup, fewer_bytes, kb_per_sample, last_step = {}, {}, {}, {}, {}
    for name, summary in summaries.items():
        samples_per_s[name] = round(summary["samples_per_second"] * args.time_scale, 1)
        ends = summary["step_seconds"]
        if len(ends) >= 2:  # past the first step: the pipeline filled, and a window sized to it
            last_step[name] = round(args.target_batch_size / (ends[-1] - ends[-2]) * args.time_scale, 1)
        kb_per_sample[name] = round(bytes_per_sample(summary) / 1024, 1)
        baseline = summaries.get(run_name(baseline_model, "none", links[name]))
        if baseline is not None and links[name] is not None:
            speedup[name] = round(summary["samples_per_second"] / baseline["samples_per_second"], 2)
            fewer_bytes[name] = round(bytes_per_sample(baseline) / bytes_per_sample(summary), 2)
    return {
        "samples_per_s": samples_per_s,
        "speedup_vs_none": speedup,
        "samples_per_s_last_step": last_step,
        "times_fewer_bytes_than_none": fewer_bytes,
        "wire_kb_per_sample": kb_per_sample,
    }


def main() -> None:
    args, runs_by_model = parse_runs()
    baseline_model = next(iter(runs_by_model))
    workdir = Path(tempfile.mkdtemp(prefix="bench-wan-"))
    summaries, links = run_swarms(args, runs_by_model, workdir)
    print(
        json.dumps(
            {
                "bench": "wan",
                "latency_ms": args.latency_ms,
                "bandwidths_mbit": args.bandwidths_mbit,
                "time_scale": args.time_scale,
                "num_stages": args.num_stages,
                "steps": args.steps,
                "target_batch_size": args.target_batch_size,
                "microbatch_size": args.microbatch_size,
                "max_in_flight": args.max_in_flight,
                "overlap_steps": args.overlap_steps,
                "in_flight_ceiling": args.in_flight_ceiling,
                "trainer_link_capped": not args.uncapped_trainer,
                **figures(args, summaries, links, baseline_model),
                "retries": {name: summary["retries"] for name, summary in summaries.items()},
                # per run: the window at the end of each step, and the smallest round trip it measured
                "in_flight_window_per_step": (
                    {name: s["in_flight_window_per_step"] for name, s in summaries.items()}
                    if args.max_in_flight is None
                    else {}
                ),
                "in_flight_round_trip_s": (
                    {name: s["in_flight_round_trip_s"] for name, s in summaries.items()}
                    if args.max_in_flight is None
                    else {}
                ),
                "auto_choices": {name: s["codecs"] for name, s in summaries.items() if ":auto@" in name},
            }
        )
    )


if __name__ == "__main__":
    main()
