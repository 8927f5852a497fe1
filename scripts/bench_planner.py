"""The planner against brute force over a grid of scenarios, and its time for a large swarm; prints one JSON object.

Grid: inter-region links of `--bandwidths` Mbit/s and `--round-trips` ms, peers spread over `--regions`
regions, heterogeneous devices (a random mix of the `DEVICES` below, `--seeds` draws per cell), one
trainer. Each scenario has `--peers` peers (brute force tries every layout, so a handful) and a model of
`--blocks` blocks of `--d-model` width (a wide one, so that cards must share it). For each, the
planner's plan and the best of every stage count, cut, layout and microbatch size are judged by the same
model (`swarm.planning.pipeline_model`); reported: the share of scenarios where the planner comes within
5% of brute force (scenarios no layout holds are counted apart), the worst ratio, and the scenarios
below 5%. Then the time to plan `--large` peers over 8 regions with 4 trainers (median of 3, one
process; CPU seconds beside wall seconds). With `--simulate N` (10 by default), the planner's plan and
brute force's N best are also run as events (scripts/simulation/pipeline_flow.py: queues on every link
and device, windows, random routing): reported, the planner's simulated samples/s against the best of
those, and against its own prediction.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import statistics
import sys
import time

from simulation.pipeline_flow import simulate_plan
from swarm.models.registry import get_model_spec
from swarm.planning.cluster import MEBIBIT, Cluster, ModelCosts, Network, PlanPeer, PlanTrainer
from swarm.planning.exhaustive import best_plans
from swarm.planning.pipeline_model import LinkView
from swarm.planning.planner import plan_pipeline

GIB = 2**30
# (name, flops/s sustained, memory bytes, link Mbit/s): data-centre and consumer cards, and a weak one
DEVICES = (
    ("h100", 300e12, 80 * GIB, 10_000),
    ("a100", 150e12, 40 * GIB, 10_000),
    ("a10", 60e12, 24 * GIB, 1_000),
    ("t4", 25e12, 16 * GIB, 1_000),
    ("rtx3060", 12e12, 12 * GIB, 300),
)


def scenario(
    model: ModelCosts, peers: int, regions: int, mbit: float, rtt_ms: float, seed: int, trainers: int = 1
) -> Cluster:
    """A cluster of `peers` random devices in `regions` regions linked at `mbit` and `rtt_ms`."""
    rng = random.Random(seed)
    members = []
    for i in range(peers):
        name, flops, memory, link = rng.choice(DEVICES)
        members.append(PlanPeer(f"{name}-{i}", flops, memory, link * MEBIBIT, f"r{rng.randrange(regions)}"))
    names = [f"r{r}" for r in range(regions)]
    pairs = itertools.combinations(names, 2)
    network = Network(
        round_trips={pair: rtt_ms / 1e3 for pair in itertools.combinations(names, 2)},
        bandwidths={pair: mbit * MEBIBIT for pair in pairs},
    )
    coaches = tuple(PlanTrainer(f"trainer{t}", 10_000 * MEBIBIT, f"r{t % regions}") for t in range(trainers))
    return Cluster(model, tuple(members), coaches, network, target_batch_size=1024)


def grid(args: argparse.Namespace, model: ModelCosts) -> dict:
    ratios, misses, shapes, infeasible = [], [], collections.Counter(), 0
    planner_seconds, brute_seconds = [], []
    simulated, accuracy = [], []  # planner against the best simulated; simulated over predicted
    cells = itertools.product(args.bandwidths, args.round_trips, args.regions, range(args.seeds))
    for mbit, rtt, regions, seed in cells:
        cluster = scenario(model, args.peers, regions, mbit, rtt, seed)
        view = LinkView(cluster)
        start = time.perf_counter()
        chosen = plan_pipeline(cluster, view)
        planner_seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        ranked = best_plans(cluster, view, max_stages=args.max_stages, keep=max(1, args.simulate))
        best = ranked[0][1]
        brute_seconds.append(time.perf_counter() - start)
        if best.samples_per_s <= 0:  # no layout holds the model on these cards: nothing to compare
            infeasible += 1
            continue
        ratio = chosen.prediction.samples_per_s / best.samples_per_s
        ratios.append(ratio)
        if args.simulate:
            ours = simulate_plan(chosen.plan, view)
            simulated.append(ours / max(simulate_plan(plan, view) for plan, _ in ranked))
            accuracy.append(ours / chosen.prediction.samples_per_s)
        shapes[f"{len(chosen.plan.blocks)} stages, microbatch {chosen.plan.microbatch}"] += 1
        if ratio < 0.95:
            misses.append({"mbit": mbit, "rtt_ms": rtt, "regions": regions, "seed": seed, "ratio": round(ratio, 4)})
    return {
        "scenarios": len(ratios),
        "infeasible": infeasible,
        "within_5_percent": round(sum(r >= 0.95 for r in ratios) / len(ratios), 4),
        "worst_ratio": round(min(ratios), 4),
        "median_ratio": round(statistics.median(ratios), 4),
        "above_brute_force": sum(
            r > 1.0 + 1e-9 for r in ratios
        ),  # the planner may use more stages than brute force tries
        "misses": misses,
        "planner_plans": dict(shapes.most_common()),
        "planner_seconds_median": round(statistics.median(planner_seconds), 4),
        "brute_force_seconds_median": round(statistics.median(brute_seconds), 3),
        **(_simulated(simulated, accuracy, args.simulate) if args.simulate else {}),
    }


def _simulated(ratios: list[float], accuracy: list[float], ranked: int) -> dict:
    """The planner's plan in the event simulation against the best of brute force's `ranked` top plans there, and
    its simulated samples/s over its predicted ones."""
    return {
        "simulated_top_plans": ranked,
        "simulated_within_5_percent": round(sum(r >= 0.95 for r in ratios) / len(ratios), 4),
        "simulated_worst_ratio": round(min(ratios), 4),
        "simulated_over_predicted": {
            "min": round(min(accuracy), 3),
            "median": round(statistics.median(accuracy), 3),
            "max": round(max(accuracy), 3),
        },
    }


def large(args: argparse.Namespace) -> dict:
    model = ModelCosts.from_spec(get_model_spec(args.large_model, d_model=args.large_d_model))
    cluster = scenario(model, args.large, 8, 1000.0, 50.0, seed=1, trainers=4)
    walls, cpus = [], []
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        chosen = plan_pipeline(cluster)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {
        "peers": args.large,
        "model": args.large_model,
        "d_model": args.large_d_model,
        "seconds": round(statistics.median(walls), 3),
        "cpu_seconds": round(statistics.median(cpus), 3),
        "num_stages": chosen.plan.num_stages,
        "blocks_per_stage": list(chosen.plan.blocks),
        "microbatch_size": chosen.plan.microbatch,
        "predicted_samples_per_s": round(chosen.prediction.samples_per_s, 2),
        "limited_by": chosen.prediction.limit,
        "idle": len(chosen.prediction.idle),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-xl", help="the grid's model (its width, sequence and vocabulary)")
    parser.add_argument("--d-model", type=int, default=6144, help="the grid model's width (wide: cards must share it)")
    parser.add_argument(
        "--blocks", type=int, default=8, help="blocks the grid's model is cut from (brute force grows fast)"
    )
    parser.add_argument("--peers", type=int, default=4, help="peers per grid scenario")
    parser.add_argument("--max-stages", type=int, default=4, help="the most stages brute force tries")
    parser.add_argument("--bandwidths", type=float, nargs="+", default=[10, 30, 100, 300, 1000], help="Mbit/s")
    parser.add_argument("--round-trips", type=float, nargs="+", default=[1, 20, 200], help="ms")
    parser.add_argument("--regions", type=int, nargs="+", default=[2, 4, 8], help="regions per scenario")
    parser.add_argument("--seeds", type=int, default=2, help="device draws per grid cell")
    parser.add_argument(
        "--simulate", type=int, default=10, help="run the planner's plan and brute force's best N as events (0: no)"
    )
    parser.add_argument("--large", type=int, default=1000, help="peers of the timing run (0: skip it)")
    parser.add_argument("--large-model", default="gpt-xl", help="the timing run's model")
    parser.add_argument("--large-d-model", type=int, default=8192, help="its width (no card holds it whole)")
    args = parser.parse_args(argv)
    spec = get_model_spec(args.model, d_model=args.d_model, n_layer=args.blocks)
    model = ModelCosts.from_spec(spec)
    result = {"grid": grid(args, model), "model": args.model, "d_model": args.d_model, "blocks": args.blocks}
    result["peers"] = args.peers
    if args.large:
        result["large"] = large(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
