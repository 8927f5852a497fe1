"""How long one whole balance plan takes, and how close it comes to the ideal; prints one JSON object.

Every peer computes the balance rule's plan (`swarm.policy.balance.plan_moves`) from the swarm's records
once per check, so its cost grows with the swarm. For each size, the peers start skewed (70% on
stage 0, the rest spread, as `scripts/simulate.py --start skewed`) with speeds spread 10x and a few
per cent of measurement noise (so no two are equal, as measured throughputs are not); the plan is
computed `--repeats` times on one core and the median time reported. The plan's fraction of the
ideal is the least stage capacity after all its moves over sum(speeds) / sum(costs), an upper bound
of the ideal (exact for these sizes to well under 1%).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from swarm.policy.balance import PeerLoad, capacities, plan_moves, upper_bound_throughput


def skewed_swarm(peers: int, stages: int, seed: int) -> list[PeerLoad]:
    """`peers` peers, 70% on stage 0 and the rest spread, speeds 2 to 20 samples/s with 2% noise."""
    rng = random.Random(seed)
    on_first = round(0.7 * peers)
    layout = [0] * on_first + [1 + i % (stages - 1) for i in range(peers - on_first)]
    rng.shuffle(layout)
    return [
        PeerLoad(f"peer{i:06d}", stage, rng.randint(2, 20) * (1 + rng.gauss(0, 0.02))) for i, stage in enumerate(layout)
    ]


def measure(peers: int, stages: int, margin: float, repeats: int, seed: int) -> dict:
    swarm = skewed_swarm(peers, stages, seed)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        plan = plan_moves(swarm, stages, margin)
        times.append(time.perf_counter() - started)
    target = {m.peer_id: m.target for m in plan}
    after = [PeerLoad(p.peer_id, target.get(p.peer_id, p.stage), p.throughput) for p in swarm]
    bound = upper_bound_throughput([p.throughput for p in swarm], stages)
    return {
        "peers": peers,
        "plan_ms_median": round(1000 * statistics.median(times), 2),
        "plan_ms_max": round(1000 * max(times), 2),
        "moves": len(plan),
        "fraction_of_ideal_before": round(min(capacities(swarm, stages)) / bound, 4),
        "fraction_of_ideal_after": round(min(capacities(after, stages)) / bound, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="comma list of swarm sizes")
    parser.add_argument("--stages", type=int, default=8, help="pipeline stages")
    parser.add_argument("--margin", type=float, default=0.5, help="the balance rule's hysteresis margin")
    parser.add_argument("--repeats", type=int, default=7, help="plans timed per size (the median is reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of speeds and layout")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        print(f"bench_plan.py: --sizes must be a comma list of numbers, got {args.sizes!r}", file=sys.stderr)
        return 2
    if args.stages < 2 or args.repeats < 1 or not sizes or min(sizes) < args.stages:
        print("bench_plan.py: need --stages >= 2, --repeats >= 1 and every size >= --stages", file=sys.stderr)
        return 2
    results = [measure(n, args.stages, args.margin, args.repeats, args.seed) for n in sizes]
    print(json.dumps({"stages": args.stages, "margin": args.margin, "repeats": args.repeats, "sizes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
