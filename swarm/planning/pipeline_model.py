"""The predicted samples/s of a plan: stage capacities, the trainers' links and windows, averaging's share.

The model follows the swarm's data flow. A trainer calls every stage in turn, twice per microbatch
(a forward, then a backward that carries the stage's input again and recomputes it), so each call
costs a round trip between the trainer and the peer, and every boundary tensor crosses the
trainer's link. A peer overlaps its compute with its transfers: its rate is the microbatch over the
longer of the two. Compute is the stage's flops over the peer's, a fixed overhead per call, and the
codec's coding time; transfers are the encoded bytes over the narrower of the peer's link and the
link between its region and the trainer's. Routing weighs peers by speed, so a stage's capacity is
the sum of its peers' rates. Stage-mates average each step's gradients on the same links, which
takes a share of each peer's link time that grows with the step rate (a fixed point, found by a few
iterations). A trainer's samples/s are bounded by its link and by its window over its round trip
(Little's law). The plan's window is `WINDOW_MARGIN` times what that round trip needs at the
predicted rate: calls queue at heterogeneous peers, and in the event simulation
(scripts/simulation/pipeline_flow.py) plans of 2 and 3 stages delivered 0.66-0.95 of the prediction
with windows of 1.25 times the bandwidth-delay product, 0.90-1.0 with twice it, 1.00-1.01 with 4 times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from swarm.compression.link_choice import choose_codec
from swarm.planning.cluster import Cluster

WINDOW_MARGIN = 4.0  # windows this many times the bandwidth-delay product (see below)
LOSS_BYTES = 4.0  # the last stage sends back one loss per sample
AVERAGING_ITERATIONS = 3


@dataclass(frozen=True)
class Plan:
    """How the model is cut and the swarm laid out: `blocks[s]` blocks on stage s, `stages[i]` the stage of
    the cluster's i-th peer (-1: idle), one microbatch size for all trainers."""

    blocks: tuple[int, ...]
    stages: tuple[int, ...]
    microbatch: int

    @property
    def num_stages(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class Prediction:
    """What the model expects of a plan."""

    samples_per_s: float
    stage_capacity: tuple[float, ...]  # samples/s
    trainer_link: tuple[float, ...]  # samples/s each trainer's link carries at most
    round_trip: tuple[float, ...]  # seconds one microbatch takes through all stages, per trainer
    windows: tuple[int, ...]  # microbatches in flight each trainer keeps
    idle: tuple[str, ...]  # peers that cannot hold their stage (memory) or have none
    limit: str  # what holds the rate: "stage N", "trainer links" or "windows"


class LinkView:
    """The per-link facts of a cluster that no plan changes: each (trainer, peer) link's codec, as the trainer's
    own rule picks it from the link's bandwidth, and its round trip and bandwidth."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        net, profiles = cluster.network, {c.name: c for c in cluster.codecs}
        self.codec: list[list[str]] = []  # [trainer][peer]
        self.ratio: list[list[float]] = []
        self.round_trip: list[list[float]] = []
        self.bandwidth: list[list[float]] = []
        for t in cluster.trainers:
            rows: tuple[list, list, list, list] = ([], [], [], [])
            for p in cluster.peers:
                link = min(t.bandwidth, p.bandwidth, net.bandwidth(t.region, p.region))
                codec = choose_codec(cluster.codecs, link, cluster.max_codec_error)
                for row, value in zip(
                    rows, (codec, profiles[codec].wire_ratio, net.round_trip(t.region, p.region), link)
                ):
                    row.append(value)
            for table, row in zip((self.codec, self.ratio, self.round_trip, self.bandwidth), rows):
                table.append(row)
        trainers = len(cluster.trainers)
        # a peer serves every trainer alike: its mean wire ratio and coding time, and its own link's bandwidth
        # as the narrowest of the trainers' links to it (harmonic mean over trainers)
        self.peer_ratio = [sum(self.ratio[t][i] for t in range(trainers)) / trainers for i in range(len(cluster.peers))]
        self.peer_coding = [
            sum(profiles[self.codec[t][i]].seconds_per_byte for t in range(trainers)) / trainers
            for i in range(len(cluster.peers))
        ]
        self.peer_bandwidth = [
            trainers / sum(1.0 / self.bandwidth[t][i] for t in range(trainers)) for i in range(len(cluster.peers))
        ]

    def codecs_by_region(self) -> dict[str, str]:
        """The codec each trainer-to-region link uses: "TRAINER->REGION": codec."""
        return {
            f"{t.name}->{p.region}": self.codec[ti][pi]
            for ti, t in enumerate(self.cluster.trainers)
            for pi, p in enumerate(self.cluster.peers)
        }


def stage_bytes(cluster: Cluster, num_stages: int, stage: int) -> tuple[float, float]:
    """Bytes per sample into and out of `stage`: token ids into the first (targets into the last too)."""
    model = cluster.model
    inward = model.input_bytes if stage == 0 else model.boundary_bytes
    if stage == num_stages - 1:
        return inward + (model.input_bytes if stage > 0 else 0.0), LOSS_BYTES
    return inward, model.boundary_bytes


def microbatch_seconds(
    cluster: Cluster, num_stages: int, stage: int, blocks: Any, microbatch: int, flops: Any, coding: Any, per_byte: Any
) -> tuple[Any, Any]:
    """(compute, transfer) seconds of one microbatch's forward and backward calls on `stage` of `blocks` blocks, at
    a peer of `flops` flops/s that codes a byte in `coding` seconds and moves one in `per_byte`. Plain arithmetic,
    so that numpy arrays (peers by block counts) go through it alike: the planner judges many at once."""
    inward, outward = stage_bytes(cluster, num_stages, stage)
    stage_flops = cluster.model.stage_flops(blocks, stage == 0, stage == num_stages - 1)
    compute = microbatch * (stage_flops / flops + (3 * inward + 2 * outward) * coding) + 2 * cluster.call_overhead
    return compute, microbatch * (2 * inward + outward) * per_byte


def call_seconds(
    view: LinkView, peer: int, num_stages: int, stage: int, blocks: int, microbatch: int
) -> tuple[float, float]:
    """(compute, transfer) seconds of one microbatch's forward and backward calls at `peer` on `stage`."""
    per_byte = view.peer_ratio[peer] / view.peer_bandwidth[peer]
    flops = view.cluster.peers[peer].flops
    return microbatch_seconds(
        view.cluster, num_stages, stage, blocks, microbatch, flops, view.peer_coding[peer], per_byte
    )


def fits(cluster: Cluster, peer: int, num_stages: int, stage: int, blocks: int, microbatch: int) -> bool:
    """Whether the peer's memory holds the stage's state and one microbatch's activations."""
    need = cluster.model.stage_memory(blocks, stage == 0, stage == num_stages - 1, microbatch)
    return need <= cluster.peers[peer].memory


def averaging_seconds(
    cluster: Cluster, num_stages: int, stage: int, blocks: int, mates: int, bandwidth: float
) -> float:
    """Link seconds one peer spends per step averaging with `mates - 1` others (reduce-scatter, all-gather)."""
    if mates < 2:
        return 0.0
    gradient = cluster.model.stage_state_bytes(blocks, stage == 0, stage == num_stages - 1) / 4  # float32
    return 2 * gradient * (mates - 1) / mates / bandwidth


def predict(plan: Plan, view: LinkView) -> Prediction:
    """The samples/s the plan is expected to give, and what holds it there."""
    cluster, num_stages, m = view.cluster, plan.num_stages, plan.microbatch
    members: list[list[int]] = [[] for _ in range(num_stages)]
    idle = []
    for i, stage in enumerate(plan.stages):
        if 0 <= stage < num_stages and fits(cluster, i, num_stages, stage, plan.blocks[stage], m):
            members[stage].append(i)
        else:
            idle.append(cluster.peers[i].name)
    calls = {i: call_seconds(view, i, num_stages, s, plan.blocks[s], m) for s in range(num_stages) for i in members[s]}
    averaging = {
        i: averaging_seconds(cluster, num_stages, s, plan.blocks[s], len(members[s]), view.peer_bandwidth[i])
        for s in range(num_stages)
        for i in members[s]
    }
    rates: dict[int, float] = {}
    total = math.inf
    for _ in range(AVERAGING_ITERATIONS):
        steps_per_s = 0.0 if math.isinf(total) else total / cluster.target_batch_size
        for i, (compute, transfer) in calls.items():
            free = 1.0 - averaging[i] * steps_per_s  # the share of the link averaging leaves to calls
            rates[i] = m / max(compute, transfer / free) if free > 0.05 else 0.0
        capacity = tuple(sum(rates[i] for i in group) for group in members)
        total, limit, links, trips, demand = _trainer_bound(plan, view, members, rates, calls, capacity)
    windows = _windows(cluster, total, demand, trips, m)
    return Prediction(total, capacity, links, trips, windows, tuple(idle), limit)


def _trainer_bound(
    plan: Plan,
    view: LinkView,
    members: list[list[int]],
    rates: dict[int, float],
    calls: dict[int, tuple[float, float]],
    capacity: tuple[float, ...],
) -> tuple[float, str, tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """The plan's rate given the stages' capacity: (rate, limit, links, round trips, each trainer's most)."""
    cluster, num_stages, m = view.cluster, plan.num_stages, plan.microbatch
    stages_rate = min(capacity) if capacity else 0.0
    if stages_rate <= 0:
        empty = tuple(0.0 for _ in cluster.trainers)
        return 0.0, f"stage {capacity.index(0.0) if capacity else 0}", empty, empty, empty
    links, trips, demand = [], [], []
    for t, trainer in enumerate(cluster.trainers):
        per_sample_bytes, trip = 0.0, 0.0
        for s, group in enumerate(members):
            inward, outward = stage_bytes(cluster, num_stages, s)
            weight = sum(rates[i] for i in group)
            for i in group:
                share = rates[i] / weight
                ratio = view.ratio[t][i]
                per_sample_bytes += share * (2 * inward + outward) * ratio
                wire = m * (3 * inward + 2 * outward) * ratio / view.bandwidth[t][i]
                trip += share * (2 * view.round_trip[t][i] + wire + calls[i][0])
        links.append(trainer.bandwidth / per_sample_bytes)
        trips.append(trip)
        demand.append(min(links[-1], cluster.max_in_flight * m / trip))
    total = min(stages_rate, sum(demand))
    if total == stages_rate:
        limit = f"stage {capacity.index(stages_rate)}"
    elif all(d == link for d, link in zip(demand, links)):
        limit = "trainer links"
    else:
        limit = "windows"
    return total, limit, tuple(links), tuple(trips), tuple(demand)


def _windows(
    cluster: Cluster, total: float, demand: tuple[float, ...], trips: tuple[float, ...], m: int
) -> tuple[int, ...]:
    """Each trainer's window: its share of the rate times its round trip, in microbatches, with a margin."""
    if total <= 0:
        return tuple(1 for _ in trips)
    whole = sum(demand)
    return tuple(
        max(1, min(cluster.max_in_flight, math.ceil(WINDOW_MARGIN * total * d / whole * trip / m)))
        for d, trip in zip(demand, trips)
    )
