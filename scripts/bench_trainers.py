"""Benchmarks several trainers feeding one swarm, and a trainer's death; prints one JSON object.

On a local swarm (gpt-tiny, 3 stages, `--peers-per-stage` peers each):
1. one trainer alone trains `--steps` steps: its samples/s;
2. two trainers at once, on different shards of the standard library, `--steps` steps each: each
   one's samples/s, their aggregate while both ran, the aggregate over the single trainer's rate,
   and whether each one's loss fell;
3. a trainer is SIGKILLed in the middle of a step (after `--kill-after-steps` steps, seen in its
   sample ledger: some but not all of the step's microbatches fed), a new trainer is started at
   once, and the seconds from the kill until the new trainer completes its first step are reported.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos import (
    NUM_STAGES,
    PEER_FLAGS,
    Churn,
    RunFailed,
    TrainerRun,
    concurrent_rate,
    run_trainers,
    shard,
    start_trainer,
    supports_ledger,
)

from swarm.launch.local_swarm import LocalSwarm
from swarm.net.dht_node import TetheredDHT
from swarm.records.sample_ledger import account, read_ledger

TARGET_BATCH = 32
MICROBATCH = 8
PER_STEP = TARGET_BATCH // MICROBATCH  # microbatches in one trainer step


def fed_count(ledger: Path) -> int:
    """Microbatches a trainer has fed through every stage so far, from its ledger."""
    if not ledger.exists():
        return 0
    return sum(record.get("kind") == "fed" for record in read_ledger(ledger))


def trainer_report(run: TrainerRun) -> dict[str, Any]:
    summary = run.summary
    return {
        "steps": summary["steps"],
        "samples_per_s": round(summary["samples_per_second"], 2),
        "loss_first_last": [round(summary["first_loss"], 3), round(summary["last_loss"], 3)],
        "loss_fell": summary["last_loss"] < summary["first_loss"],
        "retries": summary["retries"],
    }


def kill_and_replace(
    swarm: LocalSwarm, workdir: Path, ledger_dir: Path, after_steps: int, timeout: float
) -> dict[str, Any]:
    """Kills a trainer mid-step, starts another at once; returns the seconds until the new one's first step."""
    victim = start_trainer(swarm, "trainer-victim", 10_000, workdir, ledger_dir, shard(0))
    assert victim.ledger is not None
    deadline = time.monotonic() + timeout
    fed = 0
    while True:
        if not victim.poll():
            raise RunFailed(f"the trainer to kill exited {victim.process.returncode} early; see {victim.log}")
        fed = fed_count(victim.ledger)
        # mid-step: a few steps done, and some but not all of the current step's microbatches
        if fed >= after_steps * PER_STEP and fed % PER_STEP:
            break
        if time.monotonic() > deadline:
            raise RunFailed(f"the trainer to kill fed {fed} microbatches in {timeout:.0f}s; see {victim.log}")
        time.sleep(0.02)  # a step's microbatches land within a fraction of a second of each other
    killed_at = time.monotonic()
    # the whole process group, DHT child and daemons too, as when its machine dies
    swarm.stop(victim.name, signal.SIGKILL, timeout=5)
    successor = start_trainer(swarm, "trainer-successor", 3, workdir, ledger_dir, shard(1))
    assert successor.ledger is not None
    first_step_at = None
    while successor.poll():
        if first_step_at is None and fed_count(successor.ledger) >= PER_STEP:
            first_step_at = time.monotonic()
        if time.monotonic() - killed_at > timeout:
            raise RunFailed(f"the new trainer had no step {timeout:.0f}s after the kill; see {successor.log}")
        time.sleep(0.05)
    if successor.process.returncode != 0:
        raise RunFailed(f"the new trainer exited {successor.process.returncode}; see {successor.log}")
    successor.summary = json.loads(successor.summary_file.read_text())
    if first_step_at is None:  # it finished between two looks: its own clock says when its first step ended
        first_step_at = successor.start + successor.summary["step_seconds"][0]
    return {
        "killed_after_microbatches": fed,
        "killed_after_steps": fed // PER_STEP,
        "kill_to_first_step_s": round(first_step_at - killed_at, 2),
        # of which: the new process starting and finding the swarm, then its first step itself
        "successor_startup_s": round(successor.ready - killed_at, 2) if successor.ready else None,
        "successor_first_step_s": round(successor.summary["step_seconds"][0], 2),
        "successor": trainer_report(successor),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per trainer, alone and in the pair")
    parser.add_argument("--peers-per-stage", type=int, default=1, choices=[1, 2], help="peers per stage")
    parser.add_argument("--kill-after-steps", type=int, default=3, help="steps the killed trainer does first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one phase may take")
    args = parser.parse_args()
    if not supports_ledger():
        sys.exit("this checkout's trainers have no --ledger: the kill phase watches it")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops the swarm on the way out

    workdir = Path(tempfile.mkdtemp(prefix="bench-trainers-"))
    ledger_dir = workdir / "ledger"
    ledger_dir.mkdir()
    result: dict[str, Any] = {
        "model": "gpt-tiny",
        "stages": NUM_STAGES,
        "peers_per_stage": args.peers_per_stage,
        "target_batch_size": TARGET_BATCH,
        "microbatch_size": MICROBATCH,
        "steps": args.steps,
        "workdir": str(workdir),
    }
    try:
        with LocalSwarm(workdir) as swarm:
            swarm.start_bootstrap()
            dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)  # ends with this process
            try:
                peer_flags = [*PEER_FLAGS, "--target-batch-size", str(TARGET_BATCH)]
                # only its peer starts are used here: nothing is killed but the one trainer
                churn = Churn(swarm, dht, signal.SIGKILL, random.Random(0), ledger_dir, peer_flags)
                for stage in range(NUM_STAGES):
                    for _ in range(args.peers_per_stage):
                        churn.start(stage)
                churn.wait_serving(300)

                def trainers(phase: str, count: int) -> list[TrainerRun]:
                    return run_trainers(swarm, phase, count, args.steps, workdir, ledger_dir, args.timeout)

                (single,) = trainers("single", 1)
                single_rate, _ = concurrent_rate([single])
                result["single"] = trainer_report(single)
                pair = trainers("pair", 2)
                pair_rate, overlap = concurrent_rate(pair)
                result["pair"] = {
                    "trainers": [trainer_report(run) for run in pair],
                    "aggregate_samples_per_s": round(pair_rate, 2),
                    "overlap": round(overlap, 3),  # the share of the pair's span when both ran
                    "ratio_to_single": round(pair_rate / single_rate, 3),
                }
                result["kill"] = kill_and_replace(swarm, workdir, ledger_dir, args.kill_after_steps, args.timeout)
            finally:
                dht.shutdown()
        # every process has stopped: what the ledger says of the whole bench, the killed trainer included
        records = read_ledger(sorted(ledger_dir.glob("*.jsonl")))
        result["ledger"] = account(records, records)["totals"]
    except (RunFailed, KeyboardInterrupt) as e:
        result["error"] = str(e) or type(e).__name__
    print(json.dumps(result))
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
