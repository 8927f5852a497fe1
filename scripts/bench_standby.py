"""What standby copies cost with no churn: bytes per step and samples/s, on against off; prints one JSON object.

Each round starts a fresh local swarm (`--stages` stages of `--model`, `--peers-per-stage` peers
each), trains `--steps` steps with `--standby-stages 0` and then with `--standby-stages K`
(alternating which goes first from round to round, so that a machine warming up or cooling down
favours neither), and reads from the peers' logs the bytes their standby copies took, whole refreshes and
step deltas ("(N bytes over M refreshes and D deltas)"). Peers are pinned: nothing moves.

With `--after-a-death`, one peer of stage 0 is killed and a new one started in its place before the trainer
starts, in both runs of a round: the peers then saw a death, so copies run as they do under churn (every held
stage followed each announce period, `--standby-stages-under-churn` copies), which is what a swarm pays for
ten minutes after each death; the off run pays the same death with no copies.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from swarm.config import PeerConfig
from swarm.launch.local_swarm import LocalSwarm
from swarm.net.dht_node import TetheredDHT
from swarm.records.stage_records import SERVING, fetch_stage_records

TOTAL = re.compile(r"\((\d+) bytes over (\d+) refreshes(?: and (\d+) deltas)?\)")


def cpu_seconds_by_program(groups: set[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of the processes in the process `groups`: the peers themselves (the
    groups' leaders), their python children (DHT node, averager) and their libp2p daemons."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) in groups:  # pgrp
            program = "p2pd" if "p2pd" in name else "peer" if int(entry.name) in groups else "peer_children"
            totals[program] = totals.get(program, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


def wait_serving(dht: TetheredDHT, args: argparse.Namespace, dead: set[str], timeout: float = 300.0) -> None:
    """Waits until every stage shows `--peers-per-stage` serving records of peers not in `dead`."""
    deadline = time.monotonic() + timeout
    while True:
        records = fetch_stage_records(dht, "swarm", args.stages)
        serving = [[r for r in records[s] if r.state == SERVING and r.peer_id not in dead] for s in records]
        if all(len(group) == args.peers_per_stage for group in serving):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"no {args.peers_per_stage} serving peers on every stage within {timeout:.0f} s")
        time.sleep(0.5)


def replace_a_peer(swarm: LocalSwarm, dht: TetheredDHT, args: argparse.Namespace, name: str, flags: list[str]) -> str:
    """Kills peer `name` (of stage 0) and starts another in its place; returns the new one's name once it serves and
    the dead one's record has expired (every peer has then seen the death)."""
    deadline = time.monotonic() + 30.0  # its record can say serving before its log line is out
    while (found := re.search(r"peer id (\w+)", swarm.log_path(name).read_text(errors="replace"))) is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if found is None:
        raise SystemExit(f"{name} logged no peer id; see {swarm.log_path(name)}")
    dead = found.group(1)
    swarm.stop(name, signal.SIGKILL)
    new = f"{name}-again"
    swarm.start_peer(new, 0, flags)
    wait_serving(dht, args, {dead})
    # the dead peer's record expires within its TTL (the peers' default, 10 s): then every peer has seen the death
    deadline = time.monotonic() + 60
    while any(r.peer_id == dead for r in fetch_stage_records(dht, "swarm", args.stages, only=0)[0]):
        if time.monotonic() > deadline:
            raise SystemExit(f"the record of the killed peer {dead} did not expire within 60 s")
        time.sleep(0.5)
    return new


def one_run(args: argparse.Namespace, workdir: Path, standby_stages: int) -> dict:
    """A fresh swarm trained for `args.steps` steps with `standby_stages`; its samples/s and standby bytes."""
    model = ["--model", args.model, "--num-stages", str(args.stages), "--seed", "7"]
    peer_flags = [*model, "--announce-period", str(args.announce_period), "--target-batch-size", str(args.batch)]
    peer_flags += ["--standby-stages", str(standby_stages), "--standby-every", str(args.standby_every)]
    peer_flags += ["--standby-deltas", str(args.standby_deltas)]
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        names = []
        for stage in range(args.stages):
            for i in range(args.peers_per_stage):
                names.append(f"peer{stage}-{i}")
                swarm.start_peer(names[-1], stage, peer_flags)
        dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)
        try:
            wait_serving(dht, args, set())
            if args.after_a_death:
                names[0] = replace_a_peer(swarm, dht, args, names[0], peer_flags)
        finally:
            dht.shutdown()
        summary_file = workdir / "summary.json"
        trainer_flags = [*model, "--steps", str(args.steps), "--microbatch-size", str(args.microbatch)]
        trainer_flags += ["--summary-file", str(summary_file), "--no-progress", "--compression", "none"]
        # each peer leads its own process group (its DHT child and daemons included)
        groups = {swarm.processes[name].pid for name in names}
        cpu_before = cpu_seconds_by_program(groups)
        trainer = swarm.start_trainer("trainer", trainer_flags)
        if trainer.wait(args.timeout) != 0:
            raise SystemExit(f"the trainer failed; see {swarm.log_path('trainer')}")
        cpu_after = cpu_seconds_by_program(groups)
        summary = json.loads(summary_file.read_text())
        standby_bytes = refreshes = deltas = 0
        for name in names:
            totals = TOTAL.findall(swarm.log_path(name).read_text(errors="replace"))
            if totals:
                standby_bytes += int(totals[-1][0])
                refreshes += int(totals[-1][1])
                deltas += max((int(t[2]) for t in totals if t[2]), default=0)
    return {
        "samples_per_s": round(summary["samples_per_second"], 2),
        "steps": summary["steps"],
        "standby_bytes": standby_bytes,
        "standby_refreshes": refreshes,
        "standby_deltas": deltas,
        # peers' copies refresh in the background from the start: bytes over the steps the stages took
        "standby_bytes_per_step": round(standby_bytes / max(1, summary["steps"])),
        # where the peers' CPU went while the trainer ran
        "peer_cpu_s_per_step": {
            program: round((cpu_after[program] - cpu_before.get(program, 0.0)) / max(1, summary["steps"]), 3)
            for program in sorted(cpu_after)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--peers-per-stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="target batch size")
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--standby-stages", type=int, default=1, help="K for the runs with standbys on")
    parser.add_argument("--standby-every", type=int, default=PeerConfig().standby_every, help="as the peers' flag")
    parser.add_argument(
        "--standby-deltas",
        type=int,
        default=PeerConfig().standby_deltas,
        help="as the peers' flag (0: copies refreshed whole only, never following their stage by step deltas)",
    )
    parser.add_argument(
        "--announce-period",
        type=float,
        default=1.0,
        help="the peers' flag; 1 s (half the peers' default) keeps records fresh in short runs, and doubles the "
        "DHT reads per step that copies add (the keeper reads the stages it holds every period)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs (off and on)")
    parser.add_argument(
        "--after-a-death",
        action="store_true",
        help="kill and replace one peer of stage 0 before training, in both runs: copies as under churn",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one trainer may take")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.standby_stages < 1:
        parser.error("--rounds, --steps and --standby-stages must be at least 1")
    if args.announce_period <= 0:
        parser.error("--announce-period must be positive")
    workdir = Path(tempfile.mkdtemp(prefix="bench-standby-"))
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for index in range(args.rounds):
        order = [("off", 0), ("on", args.standby_stages)]
        for label, k in order if index % 2 == 0 else reversed(order):
            runs[label].append(one_run(args, workdir / f"{label}{index}", k))
            print(f"round {index} {label}: {json.dumps(runs[label][-1])}", file=sys.stderr)
    off = statistics.median(r["samples_per_s"] for r in runs["off"])
    on = statistics.median(r["samples_per_s"] for r in runs["on"])
    result = {
        "model": args.model,
        "stages": args.stages,
        "peers_per_stage": args.peers_per_stage,
        "steps": args.steps,
        "standby_stages": args.standby_stages,
        "standby_every": args.standby_every,
        "standby_deltas": args.standby_deltas,
        "announce_period": args.announce_period,
        "after_a_death": args.after_a_death,
        "standby_stages_under_churn": PeerConfig().standby_stages_under_churn,
        "samples_per_s_off": round(off, 2),
        "samples_per_s_on": round(on, 2),
        "slowdown": round(1 - on / off, 3) if off else None,
        "standby_bytes_per_step": statistics.median(r["standby_bytes_per_step"] for r in runs["on"]),
        "runs": runs,
        "workdir": str(workdir),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
