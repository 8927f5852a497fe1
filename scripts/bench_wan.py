"""Throughput of the demo swarm over an emulated wide-area link, per codec; prints one JSON object.

One local swarm (a bootstrap node and one gpt-tiny peer per stage) serves a series of trainers,
each with another `--compression`, all over the same emulated link (`--emulate-bandwidth-mbit`,
`--emulate-latency-ms`: every call to a peer is delayed in the trainer's transport as such a
link would). Reported per codec: samples/s, speed-up over no compression in the same run, and
bytes on the wire per sample; for `auto`, the codec it chose per peer. A last run with no
emulated link shows what the machine itself allows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from swarm.local_swarm import LocalSwarm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0, help="emulated bandwidth each way, per peer")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="emulated one-way latency")
    parser.add_argument("--steps", type=int, default=8, help="steps per codec")
    parser.add_argument("--target-batch-size", type=int, default=128, help="samples per step")
    parser.add_argument("--microbatch-size", type=int, default=16, help="samples per microbatch")
    parser.add_argument("--max-in-flight", type=int, default=8, help="microbatches in flight")
    parser.add_argument("--codecs", nargs="+", default=["none", "fp16", "bf16", "8bit", "auto"], help="codecs to run")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-wan-"))
    model_flags = ["--model", "gpt-tiny", "--num-stages", "3"]
    link_flags = ["--emulate-bandwidth-mbit", str(args.bandwidth_mbit), "--emulate-latency-ms", str(args.latency_ms)]
    runs: dict[str, dict] = {}
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        for stage in range(3):
            swarm.start_peer(f"peer{stage}", stage, [*model_flags, "--target-batch-size", str(args.target_batch_size)])
        plan = [(codec, link_flags) for codec in args.codecs] + [("none-no-link", [])]
        for name, flags in plan:
            summary_file = workdir / f"{name}.json"
            trainer = swarm.start_trainer(
                f"trainer-{name}",
                [
                    *model_flags,
                    *flags,
                    "--compression",
                    name.removesuffix("-no-link"),
                    "--steps",
                    str(args.steps),
                    "--microbatch-size",
                    str(args.microbatch_size),
                    "--max-in-flight",
                    str(args.max_in_flight),
                    "--summary-file",
                    str(summary_file),
                    "--no-progress",
                ],
            )
            if trainer.wait() != 0:
                sys.exit(f"the {name} trainer failed; logs in {workdir}")
            runs[name] = json.loads(summary_file.read_text())
    baseline = runs["none"]["samples_per_second"] if "none" in runs else float("nan")
    result = {
        "link": {"bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms},
        "model": "gpt-tiny",
        "target_batch_size": args.target_batch_size,
        "microbatch_size": args.microbatch_size,
        "samples_per_s": {name: round(run["samples_per_second"], 2) for name, run in runs.items()},
        "speedup_vs_none": {name: round(run["samples_per_second"] / baseline, 3) for name, run in runs.items()},
        "wire_kb_per_sample": {
            name: round((run["bytes_sent"] + run["bytes_received"]) / run["samples"] / 1024, 1)
            for name, run in runs.items()
        },
        "auto_choices": runs.get("auto", {}).get("codecs", {}),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
