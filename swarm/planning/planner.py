"""The planner: stage count, cuts, which peer serves which stage, microbatch size, windows and codecs.

For each stage count and microbatch size it alternates two steps, starting from even cuts and from a
layout by memory (the largest memories in one group of equal flops, and so on, the groups given to the
stages in every order where stages are few, else in order and in reverse, so that a stage of many
blocks can go to those who can hold it):
- layout: peers go to stages one by one, those that fit the fewest stages first and the fastest
  before the slower, each to the stage it fits with the least capacity so far (longest processing
  time first, the rule that keeps the least-served stage as high as a greedy can);
- cuts: given the layout, the block counts that maximize the least stage capacity, by bisection
  over a table of each stage's capacity at every block count (uneven cuts come out of this step);
and judges each candidate with the model (`predict`), which adds what the layout steps leave out:
the trainers' links and round trips, the windows, averaging. Codecs follow the links, by the rule
the trainers run (`choose_codec`). Stage counts stop growing once three more have not beaten the
best. numpy does the per-peer arithmetic, so 1,000 peers plan in a fraction of a second.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarm.planning.cluster import Cluster
from swarm.planning.pipeline_model import LinkView, Plan, Prediction, microbatch_seconds, predict

PATIENCE = 3  # stage counts tried past the best before the search stops
PERMUTED_STAGES, PERMUTED_PEERS = 4, 256  # up to these, every order of the memory groups over the stages is tried
ROUNDS = 2  # layout-then-cuts alternations per candidate


@dataclass(frozen=True)
class PipelinePlan:
    """A chosen plan with what the model predicts of it and the codec each link uses."""

    plan: Plan
    prediction: Prediction
    codecs: dict[str, str]

    def to_dict(self, cluster: Cluster) -> dict[str, Any]:
        """The plan file's content (JSON)."""
        starts = [sum(self.plan.blocks[:s]) for s in range(self.plan.num_stages)]
        return {
            "num_stages": self.plan.num_stages,
            "blocks_per_stage": list(self.plan.blocks),
            "layer_cuts": starts[1:],
            "microbatch_size": self.plan.microbatch,
            "max_in_flight": {t.name: w for t, w in zip(cluster.trainers, self.prediction.windows)},
            "stages": {p.name: s for p, s in zip(cluster.peers, self.plan.stages) if s >= 0},
            "idle": list(self.prediction.idle),
            "codecs": self.codecs,
            "predicted_samples_per_s": round(self.prediction.samples_per_s, 3),
            "limited_by": self.prediction.limit,
            "stage_capacity": [round(c, 3) for c in self.prediction.stage_capacity],
        }


class _PeerArrays:
    """The cluster's peers as numpy columns, and each stage's capacity at every block count."""

    def __init__(self, view: LinkView) -> None:
        self.view = view
        cluster = view.cluster
        self.flops = np.array([p.flops for p in cluster.peers])
        self.memory = np.array([p.memory for p in cluster.peers])
        self.coding = np.array(view.peer_coding)
        self.per_byte = np.array(view.peer_ratio) / np.array(view.peer_bandwidth)  # transfer seconds per byte

    def rates(self, peers: np.ndarray, num_stages: int, stage: int, blocks: np.ndarray, m: int) -> np.ndarray:
        """Samples/s of each of `peers` (rows) on `stage` at each block count (columns); 0 where it does not fit."""
        cluster = self.view.cluster
        column = (peers, None)
        compute, transfer = microbatch_seconds(
            cluster,
            num_stages,
            stage,
            blocks[None, :],
            m,
            self.flops[column],
            self.coding[column],
            self.per_byte[column],
        )
        rate = m / np.maximum(compute, transfer)
        need = cluster.model.stage_memory(blocks, stage == 0, stage == num_stages - 1, m)
        return np.where(need[None, :] <= self.memory[column], rate, 0.0)


def _layout(arrays: _PeerArrays, blocks: tuple[int, ...], m: int) -> tuple[int, ...]:
    """Each peer's stage for these cuts (-1 where it fits none): most constrained first, then fastest first,
    each to the stage it fits with the least capacity so far."""
    num_stages, everyone = len(blocks), np.arange(len(arrays.flops))
    rate = np.column_stack(
        [arrays.rates(everyone, num_stages, s, np.array([blocks[s]]), m)[:, 0] for s in range(num_stages)]
    )
    fitting = (rate > 0).sum(axis=1)
    order = np.lexsort((-rate.max(axis=1), fitting))
    capacity = [0.0] * num_stages
    stages = [-1] * len(everyone)
    for i in order.tolist():
        if fitting[i] == 0:
            continue
        row = rate[i].tolist()
        s = min((s for s in range(num_stages) if row[s] > 0), key=lambda s: (capacity[s], -row[s]))
        capacity[s] += row[s]
        stages[i] = s
    return tuple(stages)


def _cuts(arrays: _PeerArrays, stages: tuple[int, ...], num_stages: int, m: int) -> tuple[int, ...] | None:
    """The block counts that maximize the least stage capacity for this layout; None if a stage has no peer."""
    n_layer = arrays.view.cluster.model.n_layer
    counts = np.arange(1, n_layer - num_stages + 2)
    layout = np.array(stages)
    table = []
    for s in range(num_stages):
        members = np.flatnonzero(layout == s)
        if not len(members):
            return None
        table.append(arrays.rates(members, num_stages, s, counts, m).sum(axis=0))  # nonincreasing in blocks
    capacity = np.array(table)

    def most_blocks(level: float) -> np.ndarray:
        return (capacity >= level).sum(axis=1)

    levels = np.unique(capacity[capacity > 0])
    low, high = 0, len(levels) - 1
    if high < 0 or most_blocks(levels[0]).min() < 1 or most_blocks(levels[0]).sum() < n_layer:
        return None
    while low < high:  # the highest level at which every stage can take enough blocks
        mid = (low + high + 1) // 2
        k = most_blocks(levels[mid])
        low, high = (mid, high) if k.min() >= 1 and k.sum() >= n_layer else (low, mid - 1)
    blocks = most_blocks(levels[low]).tolist()
    while sum(blocks) > n_layer:  # give back blocks from the tightest stage that can spare one
        s = min((s for s in range(num_stages) if blocks[s] > 1), key=lambda s: capacity[s, blocks[s] - 1])
        blocks[s] -= 1
    return tuple(blocks)


def even_blocks(n_layer: int, num_stages: int) -> tuple[int, ...]:
    base, extra = divmod(n_layer, num_stages)
    return tuple(base + (s < extra) for s in range(num_stages))


def plan_pipeline(cluster: Cluster, view: LinkView | None = None) -> PipelinePlan:
    """The best plan the search finds for the cluster."""
    view = view or LinkView(cluster)
    arrays = _PeerArrays(view)
    most = min(cluster.model.n_layer, len(cluster.peers))
    best: tuple[Plan, Prediction] | None = None
    best_stages = 0
    for num_stages in range(1, most + 1):
        if best is not None and best[1].samples_per_s > 0 and num_stages > best_stages + PATIENCE:
            break
        for m in cluster.microbatch_sizes:
            for plan in _candidates(arrays, num_stages, m):
                prediction = predict(plan, view)
                if best is None or prediction.samples_per_s > best[1].samples_per_s:
                    best, best_stages = (plan, prediction), num_stages
    assert best is not None
    return PipelinePlan(best[0], best[1], view.codecs_by_region())


def _candidates(arrays: _PeerArrays, num_stages: int, m: int) -> list[Plan]:
    """The plans one stage count and microbatch size give: from even cuts, and from layouts by memory."""
    plans = []
    even = even_blocks(arrays.view.cluster.model.n_layer, num_stages)
    plans += _alternate(arrays, even, _layout(arrays, even, m), m)
    for stages in _memory_layouts(arrays, num_stages):
        blocks = _cuts(arrays, stages, num_stages, m)
        if blocks is not None:
            plans += _alternate(arrays, blocks, stages, m)
    return plans


def _alternate(arrays: _PeerArrays, blocks: tuple[int, ...], stages: tuple[int, ...], m: int) -> list[Plan]:
    """Cuts for the layout, then the layout for the cuts, `ROUNDS` times: each plan on the way."""
    plans = [Plan(blocks, stages, m)]
    for _ in range(ROUNDS):
        better = _cuts(arrays, stages, len(blocks), m)
        if better is None or better == blocks:
            break
        blocks = better
        plans.append(Plan(blocks, stages, m))
        stages = _layout(arrays, blocks, m)
        plans.append(Plan(blocks, stages, m))
    return plans


def _memory_layouts(arrays: _PeerArrays, num_stages: int) -> list[tuple[int, ...]]:
    """Peers by memory, largest first, in groups of equal flops, the groups given to the stages in some orders: a
    stage of many blocks then goes to the peers that can hold it (the cuts follow the groups)."""
    order = np.argsort(-arrays.memory, kind="stable")
    flops = arrays.flops[order]
    before = (np.cumsum(flops) - flops) / flops.sum()  # the share of flops ahead of each peer
    groups = np.minimum((before * num_stages).astype(int), num_stages - 1)
    if len(set(groups.tolist())) < num_stages:
        return []
    layouts = []
    # stages differ (the first takes token ids, the last the head, the middle ones two boundaries): where it is
    # cheap, every order of the groups over the stages; else in order and in reverse
    if num_stages <= PERMUTED_STAGES and len(order) <= PERMUTED_PEERS:
        orders = [np.array(p) for p in itertools.permutations(range(num_stages))]
    else:
        orders = [np.arange(num_stages), np.arange(num_stages)[::-1]]
    for stage_of_group in orders:
        stages = np.empty(len(order), dtype=int)
        stages[order] = stage_of_group[groups]
        layouts.append(tuple(stages.tolist()))
    return layouts


def replan_gain(current: Plan, cluster: Cluster) -> tuple[float, PipelinePlan]:
    """How many times faster the best plan for `cluster` (new measurements) is than `current` under them;
    a swarm re-plans when this exceeds 1 plus its threshold."""
    view = LinkView(cluster)
    fresh = plan_pipeline(cluster, view)
    now = predict(current, view).samples_per_s
    return (fresh.prediction.samples_per_s / now if now > 0 else float("inf")), fresh
