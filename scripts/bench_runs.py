"""Several runs in one swarm, simulated against a lower bound and against one run after another.

Peers of several device kinds, each reclaimed and restarted at random (spot instances), serve 2-3 runs
of different models and sizes in one swarm; each peer serves the run the runs rule
(`swarm.policy.run_choice`) picks, and the stage of it the balance rule moves it to, on the rebalancing
timings real peers use (`simulation.runs_flow`).
Each run's trainers feed it at most `--trainer-share` of what the whole swarm could train of it, as a
trainer's links and window bound a real run (the planner's trainer limit). Reported, per seed and worst
over seeds:

- the time to train every run, and its ratio to the lower bound of a linear program over the same peers
  and up-times (`simulation.runs_bound`);
- the speed-up over training the same runs one after another on the same peers;
- each run's share of the compute, over its fair share (priority-weighted, within what its trainers use),
  per window, the lowest;
- the seconds a stage that churn emptied waited for a peer;
- where the compute the bound counts went: idle (placed in no run with work left, or on its way to one)
  and held back (serving a run beyond its slowest stage's pace, which the bound's split at will avoids), and
  the part of that a better split of each run's serving peers among its stages would have trained (the rest
  is the peers' wholeness).

`--free-split` replaces the balance rule within runs by each run's best split, made at once and free
whenever a run's serving peers change: the ceiling a better balance within runs could reach.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from simulation.runs_bound import lower_bound  # noqa: E402
from simulation.runs_flow import RunsScenario, SimRun, churn_trace, simulate_runs  # noqa: E402
from simulation.scenario import PEER_DEFAULTS  # noqa: E402
from swarm.models.gpt import partition_layers  # noqa: E402
from swarm.models.registry import get_model_spec  # noqa: E402
from swarm.planning.cluster import ModelCosts  # noqa: E402
from swarm.policy.run_choice import RUN_MOVE_MARGIN  # noqa: E402

DEVICES = {"h100": 250e12, "a100": 120e12, "l4": 45e12, "t4": 20e12}  # flops/s a stage's kernels reach


def model_run(name: str, model: str, num_stages: int, samples: float, share: float, total_speed: float) -> SimRun:
    """A run of a registered model cut evenly, its trainers feeding `share` of what the swarm could train."""
    spec = get_model_spec(model)
    costs = ModelCosts.from_spec(spec)
    layers = partition_layers(spec.n_layer, num_stages)
    last = num_stages - 1
    flops = tuple(costs.stage_flops(len(layers[s]), s == 0, s == last) for s in range(num_stages))
    state = tuple(costs.stage_state_bytes(len(layers[s]), s == 0, s == last) for s in range(num_stages))
    return SimRun(name, flops, state, samples, demand=share * total_speed / sum(flops))


def scenario(args: argparse.Namespace, seed: int) -> RunsScenario:
    rng = random.Random(seed)
    kinds = [kind for kind, count in zip(DEVICES, args.device_counts) for _ in range(count)]
    speeds = tuple(DEVICES[kind] * rng.uniform(0.8, 1.2) for kind in kinds)
    total = sum(speeds)
    specs = [("xl", "gpt-xl", 4, 6e6), ("large", "gpt-large", 3, 8e6), ("medium", "gpt-medium", 2, 12e6)]
    runs = tuple(model_run(*spec, args.trainer_share, total) for spec in specs[: args.runs])
    up = churn_trace(len(speeds), args.horizon_h * 3600, args.mean_up_h * 3600, args.mean_down_min * 60, rng)
    window, horizon = args.window_min * 60, args.horizon_h * 3600
    return RunsScenario(
        speeds,
        runs,
        up,
        margin=args.margin,
        balance_margin=args.balance_margin,
        dt=args.dt,
        window=window,
        horizon=horizon,
        seed=seed,
        free_split=args.free_split,
    )


def one_seed(args: argparse.Namespace, seed: int) -> dict:
    sc = scenario(args, seed)
    started = time.process_time()
    together = simulate_runs(sc, measure_split=True)
    bound = lower_bound(sc.speeds, sc.up_times, sc.runs, sc.horizon)
    # one after another, longest first, each on the peers up from where the last ended
    t = 0.0
    for run in sorted(sc.runs, key=lambda r: -r.samples * sum(r.stage_flops)):
        t = simulate_runs(sc, [run], start=t).total
    lowest = {r.name: min((w[r.name] for w in together.shares if r.name in w), default=math.nan) for r in sc.runs}
    return {
        "seed": seed,
        "total_h": round(together.total / 3600, 2),
        "lower_bound_h": round(bound / 3600, 2),
        "total_over_bound": round(together.total / bound, 3),
        "one_after_another_h": round(t / 3600, 2),
        "speedup_over_one_after_another": round(t / together.total, 2),
        "finished_h": {n: round(v / 3600, 2) for n, v in together.finished.items()},
        "lowest_share_of_fair": {n: round(v, 2) for n, v in lowest.items()},
        "refill_s": {
            "count": len(together.refills),
            "median": round(statistics.median(together.refills), 1) if together.refills else 0.0,
            "max": round(max(together.refills), 1) if together.refills else 0.0,
        },
        "moves": together.moves,
        "moves_to_another_run": together.run_moves,
        "joins": together.joins,
        "idle_share": round(together.idle_compute, 3),
        "held_back_share": round(together.held_back_compute, 3),
        "held_back_by_split_share": round(together.split_compute, 3),
        "cpu_s": round(time.process_time() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", type=int, default=3, choices=(2, 3), help="runs in the swarm: of gpt-xl, gpt-large (, gpt-medium)"
    )
    parser.add_argument(
        "--device-counts", type=int, nargs=4, default=[6, 8, 10, 8], help="peers of each kind: h100 a100 l4 t4"
    )
    parser.add_argument("--trainer-share", type=float, default=0.45, help="what a run's trainers can feed, as a share")
    parser.add_argument("--mean-up-h", type=float, default=3.0, help="mean hours a peer stays up (0: no churn)")
    parser.add_argument("--mean-down-min", type=float, default=20.0, help="mean minutes a reclaimed peer stays down")
    parser.add_argument(
        "--margin", type=float, default=RUN_MOVE_MARGIN, help="the runs rule's move margin (default: the peers')"
    )
    parser.add_argument(
        "--balance-margin",
        type=float,
        default=PEER_DEFAULTS.rebalance_margin,
        help="the balance rule's move margin within a run (the peers' --rebalance-margin)",
    )
    parser.add_argument(
        "--free-split",
        action="store_true",
        help="no balance rule within runs: each run's serving peers split at best, at once and free, whenever they "
        "change (the ceiling a better balance within runs could reach)",
    )
    parser.add_argument("--seeds", type=int, default=3, help="scenarios drawn")
    parser.add_argument("--dt", type=float, default=2.0, help="simulated seconds per step")
    parser.add_argument("--window-min", type=float, default=30.0, help="minutes over which shares are measured")
    parser.add_argument("--horizon-h", type=float, default=96.0, help="simulated hours at most")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds is how many scenarios to draw (seeds 0 to N-1): at least 1")
    results = [one_seed(args, seed) for seed in range(args.seeds)]
    worst_share = min(min(r["lowest_share_of_fair"].values()) for r in results)
    print(
        json.dumps(
            {
                "bench": "runs",
                "peers": sum(args.device_counts),
                "runs": args.runs,
                "trainer_share": args.trainer_share,
                "mean_up_h": args.mean_up_h,
                "mean_down_min": args.mean_down_min,
                "free_split": args.free_split,
                "worst_total_over_bound": max(r["total_over_bound"] for r in results),
                "worst_speedup_over_one_after_another": min(r["speedup_over_one_after_another"] for r in results),
                "worst_lowest_share_of_fair": worst_share,
                "worst_refill_s": max(r["refill_s"]["max"] for r in results),
                "scenarios": results,
            }
        )
    )


if __name__ == "__main__":
    main()
