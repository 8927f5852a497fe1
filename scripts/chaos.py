"""Runs a local swarm under failures and reports how training held up; prints one JSON object.

Two kinds of churn:
- `--kill-every S`: every S seconds (randomised, exponential) a random peer gets SIGKILL (or
  SIGTERM with `--signal term`) and a replacement for its stage is started at once.
- `--trace FILE`: a spot availability trace (`time_ms,add|remove,node` lines, as in
  ../shared/traces) replayed compressed into `--trace-minutes`: the trace's live node count, scaled
  so that its peak is `--max-peers`, is followed by starting peers (on the stage with the fewest)
  and SIGKILLing random ones.

A stage's last serving peer is never killed (its state would be gone; checkpoints cover that
case, not churn). First a trainer runs with no churn to measure the baseline throughput; then a
trainer runs through the churn. The report gives steps, samples/s over time, throughput under
churn as a fraction of the baseline, retries, bans, resent samples, the longest stall between
steps, and, per stage, the samples its optimizer stepped on against the samples fed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from hivemind import DHT
from hivemind.p2p import PeerID

from swarm.local_swarm import LocalSwarm
from swarm.spot_trace import live_peer_targets
from swarm.stage_records import SERVING, fetch_stage_records
from swarm.transport import get_peer_info

MODEL_FLAGS = ["--model", "gpt-tiny", "--num-stages", "3"]


class Churn:
    """Kills and starts peers of a LocalSwarm, keeping a count of what it did."""

    def __init__(self, swarm: LocalSwarm, dht: DHT, sig: int, rng: random.Random) -> None:
        self.swarm, self.dht, self.sig, self.rng = swarm, dht, sig, rng
        self.serial = 0
        self.stage_of: dict[str, int] = {}
        self.kills = self.starts = self.skipped = 0

    def start(self, stage: int) -> str:
        self.serial += 1
        name = f"peer{stage}-{self.serial}"
        self.swarm.start_peer(name, stage, [*MODEL_FLAGS, "--announce-period", "1", "--record-ttl", "6"])
        self.stage_of[name] = stage
        self.starts += 1
        return name

    def peer_id(self, name: str) -> str | None:
        found = re.search(r"peer id (\w+)", self.swarm.log_path(name).read_text(errors="replace"))
        return found.group(1) if found else None

    def serving(self, stage: int) -> list[str]:
        """Names of this stage's live processes whose record says serving (a fresh record, not a dead one's)."""
        records = fetch_stage_records(self.dht, "swarm", 3, only=stage)[stage]
        serving = {r.peer_id for r in records if r.state == SERVING}
        alive = [n for n, s in self.stage_of.items() if s == stage and self.swarm.processes[n].poll() is None]
        return [n for n in alive if self.peer_id(n) in serving]

    def kill(self, name: str) -> bool:
        stage = self.stage_of[name]
        if name not in self.serving(stage) or len(self.serving(stage)) < 2:
            self.skipped += 1  # never the stage's last serving peer, nor one still joining
            return False
        self.swarm.stop(name, self.sig, timeout=30)
        del self.stage_of[name]
        self.kills += 1
        return True

    def kill_random(self) -> None:
        if self.stage_of:
            name = self.rng.choice(sorted(self.stage_of))
            stage = self.stage_of[name]
            if self.kill(name):
                self.start(stage)

    def least_served_stage(self) -> int:
        return min(range(3), key=lambda stage: sum(s == stage for s in self.stage_of.values()))


def trainer_run(swarm: LocalSwarm, name: str, steps: int, workdir: Path) -> dict:
    summary_file = workdir / f"{name}.json"
    flags = [*MODEL_FLAGS, "--steps", str(steps), "--summary-file", str(summary_file), "--no-progress"]
    trainer = swarm.start_trainer(name, [*flags, "--compression", "none", "--stage-wait-timeout", "300"])
    return {"process": trainer, "summary_file": summary_file}


def finish(run: dict, timeout: float) -> dict:
    if run["process"].wait(timeout) != 0:
        sys.exit(f"a trainer failed; see {run['summary_file'].parent}")
    return json.loads(run["summary_file"].read_text())


def samples_stepped(swarm: LocalSwarm, dht: DHT) -> dict[int, int]:
    """Per stage, the samples its optimizer has stepped on, from its most advanced live peer."""
    records = fetch_stage_records(dht, "swarm", 3)

    async def ask(p2p) -> dict[int, int]:
        counts = {}
        for stage, peers in records.items():
            infos = []
            for record in peers:
                try:
                    infos.append(await get_peer_info(p2p, PeerID.from_base58(record.peer_id)))
                except Exception:
                    continue
            counts[stage] = max((info.samples_stepped for info in infos), default=-1)
        return counts

    from hivemind.p2p import P2P

    async def main() -> dict[int, int]:
        p2p = await P2P.create(initial_peers=swarm.initial_peers)
        try:
            return await ask(p2p)
        finally:
            await p2p.shutdown()

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers-per-stage", type=int, default=2, help="peers per stage at the start")
    parser.add_argument("--baseline-steps", type=int, default=20, help="steps trained with no churn first")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of churn (kill mode)")
    parser.add_argument("--kill-every", type=float, default=8.0, help="mean seconds between kills (kill mode)")
    parser.add_argument("--signal", choices=["kill", "term"], default="kill", help="how peers are taken down")
    parser.add_argument("--trace", help="replay this spot trace instead of random kills")
    parser.add_argument("--trace-minutes", type=float, default=10.0, help="compress the trace into this long")
    parser.add_argument("--max-peers", type=int, default=6, help="live peers at the trace's peak (scaled)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices")
    args = parser.parse_args()
    # a caller's timeout (or Ctrl-C) still stops every process this run started, on the way out of LocalSwarm
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    workdir = Path(tempfile.mkdtemp(prefix="chaos-"))
    rng = random.Random(args.seed)
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGTERM
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        dht = DHT(initial_peers=swarm.initial_peers, start=True)
        try:
            churn = Churn(swarm, dht, sig, rng)
            trace = live_peer_targets(args.trace, args.trace_minutes, args.max_peers, min_peers=3) if args.trace else []
            if trace:
                _, wanted = trace.pop(0)
                for index in range(wanted):
                    churn.start(index % 3)
            else:
                for stage in range(3):
                    for _ in range(args.peers_per_stage):
                        churn.start(stage)
            while any(not churn.serving(stage) for stage in range(3)):
                time.sleep(0.5)
            baseline = finish(trainer_run(swarm, "trainer-baseline", args.baseline_steps, workdir), 600)

            duration = args.trace_minutes * 60 if trace else args.duration
            # the steps the baseline would train in `duration`; churn goes on until they are done
            steps = max(1, int(baseline["samples_per_second"] * duration / 32))
            run = trainer_run(swarm, "trainer-churn", steps, workdir)
            started = time.monotonic()
            next_kill = started + rng.expovariate(1 / args.kill_every)
            while run["process"].poll() is None:
                now = time.monotonic() - started
                if trace:
                    while trace and trace[0][0] <= now:
                        _, wanted = trace.pop(0)
                        while len(churn.stage_of) < wanted:
                            churn.start(churn.least_served_stage())
                        for name in churn.rng.sample(sorted(churn.stage_of), len(churn.stage_of)):
                            if len(churn.stage_of) <= wanted:
                                break
                            churn.kill(name)
                elif not args.trace and time.monotonic() >= next_kill:
                    churn.kill_random()
                    next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
                time.sleep(0.2)
            churned = finish(run, 300)
            trace_left = len(trace)
            time.sleep(3)  # the last step's averaging rounds finish just after the trainer's step
            stepped = samples_stepped(swarm, dht)
        finally:
            dht.shutdown()

    times = [0.0, *churned["step_seconds"]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    window = 10.0
    over_time = []
    for start in range(0, int(times[-1]) + 1, int(window)):
        done = sum(1 for t in churned["step_seconds"] if start <= t < start + window)
        over_time.append(round(done * 32 / window, 2))
    fed_total = baseline["samples"] + churned["samples"]
    result = {
        "mode": f"trace {args.trace} in {args.trace_minutes} min" if args.trace else f"kill every {args.kill_every}s",
        "signal": args.signal,
        "kills": churn.kills,
        "kills_skipped_last_peer": churn.skipped,
        "peers_started": churn.starts,
        "steps_requested": steps,
        "steps": churned["steps"],
        "churn_seconds": round(churned["seconds"], 1),
        "trace_targets_not_replayed": trace_left if args.trace else None,
        "baseline_samples_per_s": round(baseline["samples_per_second"], 2),
        "churn_samples_per_s": round(churned["samples_per_second"], 2),
        "throughput_fraction": round(churned["samples_per_second"] / baseline["samples_per_second"], 3),
        "samples_per_s_per_10s": over_time,
        "longest_stall_s": round(max(gaps, default=0.0), 2),
        "retries": churned["retries"],
        "bans": churned["bans"],
        "backwards_moved": churned["backwards_moved"],
        "samples_resent": churned["samples_resent"],
        "loss_first_last": [round(churned["first_loss"], 3), round(churned["last_loss"], 3)],
        "samples_fed": fed_total,
        "samples_stepped_per_stage": stepped,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
