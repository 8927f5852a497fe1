"""Samples/s of the demo model through a local swarm and in one process, measured in the same run,
and the pipeline's utilization: each peer's busy time over the training time.

Prints one JSON object. The swarm runs as separate processes (bootstrap, one peer per stage,
trainer) on this machine; the one-process baseline trains the same model with the same batches.
Both share the machine's cores, so the ratio shows the cost of the pipeline and the wire, not a
speed-up from more hardware.

A second swarm runs the same training on simulated devices (`--simulated-speed`: each peer pads its
compute to that speed with sleep), where the peers do not compete for the cores: its utilization is
the pipeline's own, what a real swarm of separate machines would see. A peer's busy time is the time
it spent running requests (`busy_seconds` in its info), read when the trainer is done; utilization
is that over the trainer's training seconds. A third swarm repeats the simulated run with
`--overlap-steps`, where the trainer starts each step while the last backwards of the one before finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

import torch
from hivemind.p2p import P2P, PeerID

from swarm.launch.local_swarm import LocalSwarm
from swarm.models import get_model_spec
from swarm.models.optimizer import OptimizerSettings
from swarm.net.dht_node import TetheredDHT
from swarm.net.transport import get_peer_info
from swarm.records.stage_records import fetch_stage_records
from swarm.trainer.data import ByteCorpus
from swarm.trainer.reference import train_reference


def run_swarm(
    args: argparse.Namespace, peer_extra: list[str], trainer_extra: tuple[str, ...] = ()
) -> tuple[dict, list[float]]:
    """Trains on a fresh local swarm; returns the trainer's summary and each stage's peer's utilization."""
    model_flags = ["--model", args.model, "--num-stages", str(args.num_stages)]
    workdir = tempfile.mkdtemp(prefix="bench-pipeline-")
    summary_file = os.path.join(workdir, "summary.json")
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        for stage in range(args.num_stages):
            flags = [*model_flags, "--target-batch-size", str(args.target_batch_size), *peer_extra]
            swarm.start_peer(f"peer{stage}", stage, flags)
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
                *trainer_extra,
            ],
        )
        if trainer.wait() != 0:
            sys.exit(f"the trainer failed; logs in {workdir}")
        with open(summary_file) as file:
            summary = json.load(file)
        busy = asyncio.run(busy_seconds(swarm.initial_peers, args.num_stages))
    return summary, [round(seconds / summary["seconds"], 3) for seconds in busy]


async def busy_seconds(initial_peers: list[str], num_stages: int) -> list[float]:
    """Each stage's peer's busy seconds, asked of it over libp2p."""
    dht = TetheredDHT(initial_peers=initial_peers, start=True)
    try:
        records = fetch_stage_records(dht, "swarm", num_stages)
    finally:
        dht.shutdown()
    p2p = await P2P.create(initial_peers=initial_peers)
    try:
        infos = [await get_peer_info(p2p, PeerID.from_base58(records[s][0].peer_id)) for s in range(num_stages)]
    finally:
        await p2p.shutdown()
    return [info.busy_seconds for info in infos]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-tiny", help="model preset")
    parser.add_argument("--num-stages", type=int, default=3, help="pipeline stages (one peer each)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps in each measurement")
    parser.add_argument("--target-batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--microbatch-size", type=int, default=8, help="samples per microbatch")
    parser.add_argument("--max-in-flight", type=int, default=6, help="microbatches in flight in the swarm")
    parser.add_argument("--baseline-threads", type=int, default=os.cpu_count(), help="torch threads of the baseline")
    parser.add_argument(
        "--simulated-speed", type=float, default=40.0, help="samples/s of the simulated devices' run (0: no such run)"
    )
    args = parser.parse_args()

    swarm_summary, utilization = run_swarm(args, [])
    simulated = ["--simulated-speed", str(args.simulated_speed)]
    simulated_summary, simulated_utilization = run_swarm(args, simulated) if args.simulated_speed else ({}, [])
    # the same simulated devices with --overlap-steps: no stage should idle at step boundaries
    overlap_summary, overlap_utilization = (
        run_swarm(args, simulated, ("--overlap-steps",)) if args.simulated_speed else ({}, [])
    )

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
                "utilization_per_stage": utilization,
                "utilization_mean": round(sum(utilization) / len(utilization), 3),
                "simulated_speed": args.simulated_speed,
                "simulated_samples_per_s": round(simulated_summary.get("samples_per_second", 0.0), 2),
                "simulated_utilization_per_stage": simulated_utilization,
                "simulated_utilization_mean": (
                    round(sum(simulated_utilization) / len(simulated_utilization), 3) if simulated_utilization else None
                ),
                "overlap_samples_per_s": round(overlap_summary.get("samples_per_second", 0.0), 2),
                "overlap_utilization_per_stage": overlap_utilization,
                "overlap_utilization_mean": (
                    round(sum(overlap_utilization) / len(overlap_utilization), 3) if overlap_utilization else None
                ),
                "cpu_count": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
