"""Samples/s of the demo model through a local swarm and in one process, measured in the same run.

Prints one JSON object. The swarm runs as separate processes (bootstrap, one peer per stage,
trainer) on this machine; the one-process baseline trains the same model with the same batches.
Both share the machine's cores, so the ratio shows the cost of the pipeline and the wire, not a
speed-up from more hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from swarm.data import ByteCorpus
from swarm.local_swarm import LocalSwarm
from swarm.models import get_model_spec
from swarm.optimizer import OptimizerSettings
from swarm.reference import train_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-tiny", help="model preset")
    parser.add_argument("--num-stages", type=int, default=3, help="pipeline stages (one peer each)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps in each measurement")
    parser.add_argument("--target-batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--microbatch-size", type=int, default=8, help="samples per microbatch")
    parser.add_argument("--max-in-flight", type=int, default=6, help="microbatches in flight in the swarm")
    parser.add_argument("--baseline-threads", type=int, default=os.cpu_count(), help="torch threads of the baseline")
    args = parser.parse_args()

    model_flags = ["--model", args.model, "--num-stages", str(args.num_stages)]
    workdir = tempfile.mkdtemp(prefix="bench-pipeline-")
    summary_file = os.path.join(workdir, "summary.json")
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        for stage in range(args.num_stages):
            swarm.start_peer(f"peer{stage}", stage, [*model_flags, "--target-batch-size", str(args.target_batch_size)])
        trainer = swarm.start_trainer(
            "trainer",
            [
                *model_flags,
                "--steps",
                str(args.steps),
                "--microbatch-size",
                str(args.microbatch_size),
                "--max-in-flight",
                str(args.max_in_flight),
                "--summary-file",
                summary_file,
                "--no-progress",
                "--compression",
                "none",
            ],
        )
        if trainer.wait() != 0:
            sys.exit(f"the trainer failed; logs in {workdir}")
    with open(summary_file) as file:
        swarm_summary = json.load(file)

    torch.set_num_threads(args.baseline_threads)
    spec = get_model_spec(args.model)
    reference = train_reference(
        spec,
        args.num_stages,
        ByteCorpus(),
        args.steps,
        args.target_batch_size,
        args.microbatch_size,
        OptimizerSettings(),
    )
    single = reference.samples / reference.seconds
    swarm_rate = swarm_summary["samples_per_second"]
    print(
        json.dumps(
            {
                "bench": "pipeline",
                "model": args.model,
                "num_stages": args.num_stages,
                "steps": args.steps,
                "target_batch_size": args.target_batch_size,
                "microbatch_size": args.microbatch_size,
                "max_in_flight": args.max_in_flight,
                "swarm_samples_per_s": round(swarm_rate, 2),
                "single_process_samples_per_s": round(single, 2),
                "single_process_threads": args.baseline_threads,
                "ratio_swarm_to_single": round(swarm_rate / single, 3),
                "swarm_retries": swarm_summary["retries"],
                "cpu_count": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
