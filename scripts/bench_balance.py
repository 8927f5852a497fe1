"""Rebalancing on a real local swarm of simulated devices, against the ideal assignment; prints one JSON object.

Every peer is a real `swarm peer` process (its own DHT node, libp2p daemon, handlers, averaging
and balance rule) hosting a stage of gpt-micro, whose compute is padded with sleep to a speed set
here (`--simulated-speed`, integers spread 10x), so that dozens of peers fit on 2 cores. A trainer
drives microbatches through them.

Four runs, each on a fresh swarm:
- static, rebalancing off: the peers stay where they were started (`--start`, skewed by default);
- static, rebalancing on: the same peers, the same start, moving by the balance rule;
- churn, off and on: a spot trace (scaled in time and count) adds and SIGKILLs peers. With
  rebalancing on, newcomers join with `--stage auto` and peers move; off, newcomers take a stage
  at random and stay.

Every `--sample-every` seconds the bench reads the DHT: which peer serves which stage. The
assignment's throughput is computed from the speeds set here (the least, over stages, of the
summed speeds divided by the stage's cost), and divided by the ideal: the best assignment of the
live peers, computed exactly (`swarm.policy.balance.ideal_assignment`). The trainer's own samples/s are
also reported against its ideal (the best assignment for the work a trainer's sample asks of each stage,
`SimulatedSwarm.trainer_ideal`), with the trainer's pipeline overheads in them, and each stage's
averaging rounds against the trainer's step (from the peers' `--ledger` lines).

The trainer overlaps steps (`--overlap-steps`) unless `--sync-steps`: one step of 16 microbatches at a
time through seven calls (three forwards, the last stage, three backwards) leaves every stage idle while
the step fills and drains the pipeline, and its slowest call holds the next step back. A model of this
pipeline with no overheads at all caps such steps at about half the ideal, whatever the balance does;
measured here with the peers started at the ideal assignment (`--start ideal`, the machine shared, load
about 30), the trainer did 0.29 of its ideal in steps one at a time and 0.37 overlapping them, back to
back. A bench that measures the balance through the trainer must let the trainer reach the ideal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from hivemind import DHT

from harness.spot_trace import live_peer_targets
from swarm.config import PeerConfig
from swarm.launch.local_swarm import LocalSwarm
from swarm.models import get_model_spec
from swarm.net.dht_node import TetheredDHT
from swarm.policy.balance import ideal_assignment, stage_costs
from swarm.policy.router import FORWARD_SHARE_OF_BACKWARD
from swarm.records.stage_records import SERVING, fetch_stage_records

MODEL = "gpt-micro"


class SimulatedSwarm:
    """Peers of known speeds in a LocalSwarm, and the assignment read back from the DHT."""

    def __init__(self, swarm: LocalSwarm, dht: DHT, args: argparse.Namespace, rebalance: bool) -> None:
        self.swarm, self.dht, self.args, self.rebalance = swarm, dht, args, rebalance
        self.costs = stage_costs(get_model_spec(MODEL), args.stages)
        self.speed: dict[str, int] = {}  # by process name
        self.ids: dict[str, str] = {}  # process name -> peer id, once its log shows it
        self.serial = 0
        self.kills = 0

    def flags(self) -> list[str]:
        a = self.args
        rebalance = ["--rebalance-period", str(a.rebalance_period), "--rebalance-margin", str(a.margin)]
        return [
            *["--model", MODEL, "--num-stages", str(a.stages), "--target-batch-size", str(a.target_batch_size)],
            *["--announce-period", "2", "--record-ttl", "8", "--averaging-timeout", "15"],
            *["--ledger", str(self.swarm.workdir / "ledger.jsonl")],
            *(rebalance if self.rebalance else ["--rebalance-period", "0"]),
        ]

    def start(self, speed: int, stage: int | str) -> str:
        self.serial += 1
        name = f"peer{self.serial:03d}"
        self.swarm.spawn(
            name,
            "peer",
            [
                *["--stage", str(stage), "--initial-peers", *self.swarm.initial_peers],
                *["--simulated-speed", str(speed), *self.flags()],
            ],
        )
        self.speed[name] = speed
        return name

    def live(self) -> list[str]:
        return [n for n in self.speed if n in self.swarm.processes and self.swarm.processes[n].poll() is None]

    def peer_id(self, name: str) -> str | None:
        if name not in self.ids:
            found = re.search(r"peer id (\w+)", self.swarm.log_path(name).read_text(errors="replace"))
            if found:
                self.ids[name] = found.group(1)
        return self.ids.get(name)

    def assignment(self) -> dict[str, int]:
        """Live process name -> the stage it serves now (from the DHT; peers not serving are left out)."""
        records = fetch_stage_records(self.dht, "swarm", self.args.stages)
        serving = {r.peer_id: stage for stage, found in records.items() for r in found if r.state == SERVING}
        return {n: serving[pid] for n in self.live() if (pid := self.peer_id(n)) in serving}

    def throughput(self, stages: dict[str, int]) -> float:
        caps = [0.0] * self.args.stages
        for name, stage in stages.items():
            caps[stage] += self.speed[name] / self.costs[stage]
        return min(caps)

    def ideal(self, names: list[str]) -> float:
        value, _, proven = ideal_assignment([self.speed[n] for n in names], self.args.stages, self.costs)
        if not proven:
            print(f"warning: the ideal of {len(names)} peers was not proven optimal", file=sys.stderr)
        return value

    def trainer_ideal(self, names: list[str]) -> float:
        """The trainer's samples/s at the best assignment of these peers: a stage other than the last serves a
        forward and a backward of every sample (the backward recomputing the forward), the last one backward call
        that computes the loss; the balance's costs count one backward everywhere."""
        last = self.args.stages - 1
        work = [c * (1 if s == last else 1 + FORWARD_SHARE_OF_BACKWARD) for s, c in enumerate(self.costs)]
        return ideal_assignment([self.speed[n] for n in names], self.args.stages, work)[0]

    def kill_random(self, rng: random.Random) -> bool:
        """SIGKILLs a random live peer, never the last serving one of its stage."""
        stages = self.assignment()
        for name in rng.sample(self.live(), len(self.live())):
            if name in stages and sum(s == stages[name] for s in stages.values()) < 2:
                continue
            self.swarm.stop(name, signal.SIGKILL, timeout=10)
            self.kills += 1
            return True
        return False


def initial_stages(args: argparse.Namespace, count: int, rng: random.Random, speeds: list[int]) -> list[int]:
    if args.start == "one":
        return [0] * count
    if args.start == "ideal":  # the trainer's overheads alone, with nothing left for the balance to gain
        costs = stage_costs(get_model_spec(MODEL), args.stages)
        return ideal_assignment([speeds[i % len(speeds)] for i in range(count)], args.stages, costs)[1]
    # skewed: most peers on stage 0, the rest spread, every stage with at least one
    heavy = max(1, round(count * args.skew))
    stages = [0] * heavy + [1 + i % (args.stages - 1) for i in range(count - heavy)]
    rng.shuffle(stages)
    return stages


def wait_serving(sim: SimulatedSwarm, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(set(sim.assignment()) & set(names)) < len(names):
        if time.monotonic() > deadline:
            sys.exit(f"peers did not all come up within {timeout}s; see {sim.swarm.workdir}")
        time.sleep(1)


def run_phase(args: argparse.Namespace, rebalance: bool, churn: bool, workdir: Path) -> dict:
    rng = random.Random(args.seed)
    speeds = [2, 20] + [rng.randint(2, 20) for _ in range(args.peers - 2)]  # spread 10x
    phase = f"{'churn' if churn else 'static'}-{'on' if rebalance else 'off'}"
    with LocalSwarm(workdir / phase) as swarm:
        swarm.start_bootstrap()
        dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)  # ends with this process
        try:
            sim = SimulatedSwarm(swarm, dht, args, rebalance)
            targets = live_peer_targets(args.trace, args.churn_minutes, args.peers, args.stages) if churn else []
            count = targets.pop(0)[1] if churn else args.peers
            if churn and count < args.stages:
                count = args.stages
            layout = initial_stages(args, count, rng, speeds) if not churn else [i % args.stages for i in range(count)]
            names = [sim.start(speeds[i % len(speeds)], layout[i]) for i in range(count)]
            wait_serving(sim, names, 240)
            summary_file = swarm.workdir / "trainer.json"
            trainer = swarm.start_trainer(
                "trainer",
                [
                    *["--model", MODEL, "--num-stages", str(args.stages), "--steps", "100000"],
                    *["--microbatch-size", str(args.microbatch_size), "--max-in-flight", str(args.max_in_flight)],
                    *["--compression", "none", "--summary-file", str(summary_file), "--no-progress"],
                    *["--stage-wait-timeout", "300", *([] if args.sync_steps else ["--overlap-steps"])],
                    *args.trainer_flags.split(),
                ],
            )
            started = time.monotonic()
            duration = (args.churn_minutes if churn else args.minutes) * 60
            samples: list[tuple[float, float, float, int]] = []
            trainer_ideals: list[tuple[float, float]] = []  # (seconds, the trainer's ideal samples/s)
            while (now := time.monotonic() - started) < duration:
                while targets and targets[0][0] <= now:
                    _, wanted = targets.pop(0)
                    while len(sim.live()) < wanted:
                        stage = "auto" if rebalance else rng.randrange(args.stages)
                        sim.start(rng.randint(2, 20), stage)
                    while len(sim.live()) > wanted and sim.kill_random(rng):
                        pass
                stages = sim.assignment()
                live = sim.live()
                ideal = sim.ideal(live)
                value = sim.throughput(stages)
                samples.append((round(now, 1), round(value, 2), round(ideal, 2), len(live)))
                trainer_ideals.append((now, sim.trainer_ideal(live)))
                if trainer.poll() is not None:
                    sys.exit(f"the trainer stopped early; see {swarm.workdir}")
                time.sleep(args.sample_every)
            swarm.stop("trainer", signal.SIGTERM, timeout=60)
            if not summary_file.exists():
                sys.exit(f"the trainer left no summary; see {swarm.log_path('trainer')}")
            trained = json.loads(summary_file.read_text())
            moves = sum(swarm.log_path(n).read_text(errors="replace").count("Moving from stage") for n in sim.speed)
        finally:
            dht.shutdown()

    fractions = [v / i if i else 0.0 for _, v, i, _ in samples]
    half = len(fractions) // 2
    reached = next((t for (t, _, _, _), f in zip(samples, fractions) if f >= 0.9), None)
    return {
        "fraction_of_ideal_over_time": [round(f, 3) for f in fractions],
        "sample_times_s": [t for t, _, _, _ in samples],
        "live_peers_over_time": [n for _, _, _, n in samples],
        "steady_state_fraction": round(sum(fractions[half:]) / max(len(fractions) - half, 1), 3),
        "mean_fraction": round(sum(fractions) / max(len(fractions), 1), 3),
        "time_to_90pct_s": reached,
        "moves": moves,
        "kills": sim.kills,
        "peers_started": sim.serial,
        **trainer_figures(trained, trainer_ideals, duration),
        **round_figures(swarm.workdir / "ledger.jsonl", args.stages, trained),
        "loss_first_last": [round(trained["first_loss"], 3), round(trained["last_loss"], 3)],
    }


def trainer_figures(trained: dict, ideals: list[tuple[float, float]], duration: float, window: float = 20.0) -> dict:
    """The trainer's samples/s against its ideal (`SimulatedSwarm.trainer_ideal`), over its run and per window.

    Its step times count from when it found the swarm, some seconds after it was launched: the windows
    start there, so that none is counted empty for the start-up.
    """
    offset = trained["found_swarm_after_launch_s"]
    ends = [offset + t for t in trained["step_seconds"]]
    per_step = trained["samples"] / max(trained["steps"], 1)
    during = [i for t, i in ideals if t >= offset] or [ideals[-1][1]]
    measured = []
    start = offset
    while start + window <= duration:
        done = sum(1 for t in ends if start <= t < start + window)
        ideal_now = [i for t, i in ideals if start <= t < start + window] or during
        ideal_rate = sum(ideal_now) / len(ideal_now)
        measured.append(round(done * per_step / window / ideal_rate, 3) if ideal_rate else 0.0)
        start += window
    ideal = sum(during) / len(during)
    return {
        "trainer_samples_per_s": round(trained["samples_per_second"], 2),
        "trainer_ideal_samples_per_s": round(ideal, 2),
        "trainer_fraction_of_ideal": round(trained["samples_per_second"] / ideal, 3) if ideal else 0.0,
        "trainer_fraction_of_ideal_per_20s": measured,
        "trainer_steps": trained["steps"],
        "trainer_started_after_s": round(offset, 1),
    }


def round_figures(ledger: Path, stages: int, trained: dict) -> dict:
    """Per stage, the averaging rounds' mean seconds (from the peers' ledger lines) and their share of the
    trainer's mean step: how much of a step a stage spends agreeing on its gradients."""
    seconds: list[list[float]] = [[] for _ in range(stages)]
    if ledger.exists():
        for line in ledger.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("kind") == "step" and 0 <= record.get("stage", -1) < stages:
                    seconds[record["stage"]].append(record.get("round_seconds", 0.0))
    means = [sum(found) / len(found) if found else 0.0 for found in seconds]
    step = trained["seconds"] / max(trained["steps"], 1)
    return {
        "round_seconds_by_stage": [round(m, 3) for m in means],
        "round_share_of_step_by_stage": [round(m / step, 3) for m in means],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # each peer is three processes (peer, DHT node, libp2p daemon): past about 16 on 2 cores, calls time out and
    # records lapse even with rebalancing off, and the bench measures the machine rather than the balance
    parser.add_argument("--peers", type=int, default=16, help="peers (at the trace's peak, under churn)")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages")
    parser.add_argument(
        "--start", choices=["skewed", "one", "ideal"], default="skewed", help="where peers start (ideal: the best)"
    )
    parser.add_argument("--skew", type=float, default=0.6, help="share of peers that start on stage 0 (skewed)")
    parser.add_argument("--minutes", type=float, default=3.0, help="length of each static run")
    parser.add_argument("--rebalance-period", type=float, default=10.0, help="peers' mean seconds between checks")
    parser.add_argument(
        "--margin",
        type=float,
        default=PeerConfig().rebalance_margin,
        help="the balance rule's hysteresis margin (default: the peers')",
    )
    # small enough for tens of steps per run: the trainer's samples/s count whole steps only
    parser.add_argument("--target-batch-size", type=int, default=64, help="samples per optimizer step")
    parser.add_argument("--microbatch-size", type=int, default=4, help="samples per microbatch")
    parser.add_argument("--max-in-flight", type=int, default=64, help="microbatches the trainer keeps in flight")
    parser.add_argument("--sample-every", type=float, default=3.0, help="seconds between reads of the assignment")
    parser.add_argument(
        "--trace",
        default=str(Path(__file__).resolve().parents[2] / "shared/traces/aws-p3-spot.csv"),
        help="spot trace replayed in the churn runs (time_ms,add|remove,node lines)",
    )
    parser.add_argument("--churn-minutes", type=float, default=5.0, help="compress the trace into this long")
    parser.add_argument("--no-churn", action="store_true", help="skip the two runs under churn")
    parser.add_argument(
        "--phases", default="", help="comma-separated phases to run (static_off,static_on,churn_off,churn_on); all"
    )
    parser.add_argument(
        "--sync-steps", action="store_true", help="the trainer does not overlap steps (trains as one process would)"
    )
    parser.add_argument("--trainer-flags", default="", help="more flags for the trainer, e.g. '--overlap-steps'")
    parser.add_argument("--seed", type=int, default=0, help="seed of speeds, layout and churn")
    args = parser.parse_args()
    if args.start == "one":
        print("note: with every peer on one stage and rebalancing off, the swarm cannot train", file=sys.stderr)

    workdir = Path(tempfile.mkdtemp(prefix="bench-balance-"))
    print(f"logs and ledgers in {workdir}", file=sys.stderr)
    began = time.monotonic()
    result: dict = {"peers": args.peers, "stages": args.stages, "start": args.start, "margin": args.margin}
    result["trainer_overlaps_steps"] = not args.sync_steps
    phases = [("static_off", False, False), ("static_on", True, False)]
    if not args.no_churn:
        phases += [("churn_off", False, True), ("churn_on", True, True)]
    for key, rebalance, churn in phases:
        if key == "static_off" and args.start == "one" or args.phases and key not in args.phases.split(","):
            continue
        print(f"running {key}", file=sys.stderr)
        result[key] = run_phase(args, rebalance, churn, workdir)
        # each phase takes minutes: what it found is kept even if a later one fails
        print(f"{key}: {json.dumps(result[key])}", file=sys.stderr, flush=True)
    if "static_off" in result and "static_on" in result:
        result["steady_state_ratio_on_to_off"] = round(
            result["static_on"]["steady_state_fraction"] / max(result["static_off"]["steady_state_fraction"], 1e-9), 3
        )
    result["wall_s"] = round(time.monotonic() - began, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
