"""Start-up seconds: the demo's swarm from launch to its trainer's first step, and a newcomer from launch
to serving on a busy stage; prints one JSON object.

Cold start, as `swarm demo` does it: a bootstrap node, one gpt-tiny peer per stage and a trainer are
launched at once, the peers and the trainer forked from a process that imported torch and hivemind
while the bootstrap node started (`demo`); and the same with every role launched as its own program
(`demo_roles_launched`, the baseline of the same run). Reported are the seconds from the launch to the
bootstrap node's address, to each peer's record saying `serving`, to the trainer finding every stage
and to its first step done (the last two from the trainer's summary, which counts from its own
launch, shifted to the common one).

Newcomers: once the trainer has trained `--train-steps` steps, peers are launched on stage 1 one at a
time, as programs (as a user starts one), each stopped once it serves so that every one joins a swarm
of the same size. Reported per newcomer: launch to `serving` in the DHT (polled every 0.05 s), the
state download, and where its seconds went by its own account (imports, DHT, stage built, joined).
The baseline from the same run is the median first peer of a stage, which has no state to download.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from swarm.launch.local_swarm import LocalSwarm
from swarm.net.dht_node import TetheredDHT
from swarm.records.stage_records import SERVING, fetch_stage_records

FLAGS = ["--model", "gpt-tiny", "--num-stages", "3"]
BREAKDOWN = re.compile(r"s after launch \(([^)]*)\)")


def serving_peers(dht: TetheredDHT, stage: int) -> set[str]:
    return {r.peer_id for r in fetch_stage_records(dht, "swarm", 3, only=stage)[stage] if r.state == SERVING}


def wait_for(condition, timeout: float, what: str) -> float:
    """Polls `condition` every 0.05 s; returns time.monotonic() when it first holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"{what} within {timeout:.0f}s")


def breakdown(log: Path) -> dict[str, float]:
    """A peer's own account of its start-up phases, from its first "Serving" line."""
    found = BREAKDOWN.search(log.read_text(errors="replace"))
    if found is None:
        return {}
    return {
        name: float(seconds.rstrip("s")) for name, seconds in (p.rsplit(" ", 1) for p in found.group(1).split(", "))
    }


def demo_start(swarm: LocalSwarm, train_steps: int) -> tuple[dict, TetheredDHT, float]:
    """Launches the demo's swarm as `swarm demo` does; returns its start-up figures, a DHT node to watch it
    with and the time of the launch."""
    summary_file = swarm.workdir / "summary.json"
    launched, launched_wall = time.monotonic(), time.time()
    swarm.start_bootstrap()
    bootstrap_s = time.monotonic() - launched
    for stage in range(3):
        swarm.start_peer(f"peer{stage}", stage, FLAGS)
    trainer_flags = ["--steps", str(train_steps), "--summary-file", str(summary_file), "--no-progress"]
    trainer = swarm.start_trainer("trainer", [*FLAGS, *trainer_flags])
    trainer_launched_wall = time.time()
    dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)  # ends with this process
    first = [wait_for(lambda s=s: serving_peers(dht, s), 60, f"stage {s} serving") - launched for s in range(3)]
    if trainer.wait(600) != 0:
        raise SystemExit(f"the trainer failed; see {swarm.log_path('trainer')}")
    summary = json.loads(summary_file.read_text())
    shift = trainer_launched_wall - launched_wall
    figures = {
        "bootstrap_up_s": round(bootstrap_s, 2),
        "peers_serving_s": [round(t, 2) for t in first],
        "trainer_found_all_stages_s": round(summary["found_swarm_after_launch_s"] + shift, 2),
        "trainer_first_step_s": round(summary["first_step_after_launch_s"] + shift, 2),
        "peer_phases_s": breakdown(swarm.log_path("peer1")),
    }
    return figures, dht, statistics.median(first)


def newcomers(swarm: LocalSwarm, dht: TetheredDHT, count: int) -> dict:
    """Peers launched on stage 1 one at a time, as a user starts one, each stopped once it serves."""
    joins, downloads, phases = [], [], []
    for index in range(count):
        before = serving_peers(dht, 1)
        name = f"newcomer{index}"
        started = time.monotonic()
        swarm.start_peer(name, 1, FLAGS, forked=False)
        joins.append(wait_for(lambda b=before: serving_peers(dht, 1) - b, 60, f"{name} serving") - started)
        log = swarm.log_path(name)
        wait_for(lambda log=log: breakdown(log), 30, f"{name}'s serving line")  # logged after announcing
        found = re.search(r"Joined stage 1 at step \d+ in ([\d.]+)s", log.read_text(errors="replace"))
        downloads.append(float(found.group(1)) if found else float("nan"))
        phases.append(breakdown(log))
        swarm.stop(name)
    return {
        "launch_to_serving_s": [round(t, 2) for t in joins],
        "median_s": round(statistics.median(joins), 2),
        "state_download_s": downloads,
        "phases_s": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--newcomers", type=int, default=3, help="peers to join stage 1, one at a time")
    parser.add_argument("--train-steps", type=int, default=10, help="steps trained before the first newcomer")
    args = parser.parse_args()
    result: dict = {"model": "gpt-tiny"}
    # the baseline first: every role launched as its own program, importing torch and hivemind itself
    with LocalSwarm(Path(tempfile.mkdtemp(prefix="bench-startup-launched-"))) as swarm:
        result["demo_roles_launched"], dht, _ = demo_start(swarm, args.train_steps)
        dht.shutdown()
    with LocalSwarm(Path(tempfile.mkdtemp(prefix="bench-startup-")), preloaded=True) as swarm:
        result["demo"], dht, first_peer_s = demo_start(swarm, args.train_steps)
        try:
            result["newcomer"] = newcomers(swarm, dht, args.newcomers)
        finally:
            dht.shutdown()
    launched, forked = result["demo_roles_launched"], result["demo"]
    result["demo_first_step_ratio"] = round(forked["trainer_first_step_s"] / launched["trainer_first_step_s"], 3)
    result["newcomer"]["ratio_to_first_peer"] = round(result["newcomer"]["median_s"] / first_peer_s, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
