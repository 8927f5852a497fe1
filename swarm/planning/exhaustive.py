"""The best plan by brute force, for small clusters: every stage count, every cut, every layout, every
microbatch size, each judged by the same model as the planner's. What the planner is measured against."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from swarm.planning.cluster import Cluster
from swarm.planning.pipeline_model import LinkView, Plan, Prediction, predict

MAX_LAYOUTS = 2_000_000  # stage counts, cuts, layouts and microbatches together; beyond it, refuse


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as `parts` positive whole numbers, in order."""
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *bars, total)
        yield tuple(b - a for a, b in itertools.pairwise(edges))


def search_size(cluster: Cluster, max_stages: int | None = None) -> int:
    """How many plans the brute force judges."""
    n, peers = cluster.model.n_layer, len(cluster.peers)
    most = min(n, peers, max_stages or n)
    cuts = sum(sum(1 for _ in compositions(n, s)) * s**peers for s in range(1, most + 1))
    return cuts * len(cluster.microbatch_sizes)


def best_plan(cluster: Cluster, view: LinkView | None = None, max_stages: int | None = None) -> tuple[Plan, Prediction]:
    """The plan with the most predicted samples/s among all of them (layouts that leave a stage empty skipped)."""
    return best_plans(cluster, view, max_stages, keep=1)[0]


def best_plans(
    cluster: Cluster, view: LinkView | None = None, max_stages: int | None = None, keep: int = 1
) -> list[tuple[Plan, Prediction]]:
    """The `keep` plans with the most predicted samples/s, best first."""
    if search_size(cluster, max_stages) > MAX_LAYOUTS:
        raise ValueError(f"brute force over {search_size(cluster, max_stages):,} plans is too many; use fewer peers")
    view = view or LinkView(cluster)
    n, peers = cluster.model.n_layer, len(cluster.peers)
    kept: list[tuple[float, int, Plan, Prediction]] = []  # a heap of the best, worst on top
    serial = itertools.count()
    for num_stages in range(1, min(n, peers, max_stages or n) + 1):
        layouts = [s for s in itertools.product(range(num_stages), repeat=peers) if len(set(s)) == num_stages]
        for blocks in compositions(n, num_stages):
            for m in cluster.microbatch_sizes:
                for stages in layouts:
                    plan = Plan(blocks, stages, m)
                    prediction = predict(plan, view)
                    entry = (prediction.samples_per_s, -next(serial), plan, prediction)
                    if len(kept) < keep:
                        heapq.heappush(kept, entry)
                    elif entry[:2] > kept[0][:2]:
                        heapq.heapreplace(kept, entry)
    return [(plan, prediction) for _, _, plan, prediction in sorted(kept, key=lambda e: e[:2], reverse=True)]
