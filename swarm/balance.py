"""The balance rule: which stage a newcomer joins, and which peers move to the bottleneck. Pure.

A pipeline runs no faster than its slowest stage, so the swarm's throughput is the minimum over
stages of their capacity, a stage's capacity being the summed throughput of its peers. Every peer
reads the same announcements, so every peer can compute the same plan and carry out its own part.

A move takes a peer from a donor stage to the bottleneck. It is made only if it raises the
capacity of the lower of the two stages by more than a hysteresis margin (a fraction of the moving
peer's own throughput): the bottleneck must gain and the donor must not fall to where the
bottleneck was. When the bottleneck was the only stage at the minimum, the swarm's throughput
rises; when several stages tie, one fewer sits at the minimum and the next move can lift the rest.
Two stages with equal loads never trade a peer back and forth (the donor would end lower than the
bottleneck started), and a donor keeps at least one serving peer, so no stage is ever left empty.

Peers differ in speed and stages in cost (a stage with more layers takes longer per sample), so a
peer's throughput on another stage is estimated as its throughput on its own, scaled by the ratio
of the two stages' costs.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.models.gpt import partition_layers
from swarm.models.registry import ModelSpec
from swarm.stage_records import JOINING, SERVING, StageRecord


@dataclass(frozen=True)
class PeerLoad:
    """What the balance rule needs to know of one peer."""

    peer_id: str
    stage: int
    throughput: float  # samples per second on its stage
    serving: bool = True  # False: joining, so it adds capacity but holds no state to keep a stage alive
    queue_length: int = 0
    movable: bool = True  # False: it never rebalances, so no plan may count on moving it


@dataclass(frozen=True)
class Move:
    """One peer leaving `source` for `target`, with the capacity of the lower of the two before and after."""

    peer_id: str
    source: int
    target: int
    low_before: float
    low_after: float


def loads_from_records(records: dict[int, list[StageRecord]]) -> list[PeerLoad]:
    """The peers that count toward capacity: serving ones, and joining ones (about to serve)."""
    return [
        PeerLoad(r.peer_id, stage, max(float(r.throughput), 0.0), r.state == SERVING, r.queue_length, r.movable)
        for stage, found in records.items()
        for r in found
        if r.state in (SERVING, JOINING) and r.stage == stage
    ]


def stage_costs(spec: ModelSpec, num_stages: int) -> list[float]:
    """Relative compute per sample of each stage (mean 1), from the matrix multiplications it holds."""
    d, layers = spec.d_model, partition_layers(spec.n_layer, num_stages)
    per_block = (4 + 2 * spec.mlp_ratio) * d * d + 2 * spec.seq_len * d  # projections, then attention scores
    costs = []
    for stage in range(num_stages):
        cost = len(layers[stage]) * per_block
        if stage == num_stages - 1:
            cost += d * spec.vocab_size  # the head
        if spec.bottleneck:
            cost += d * spec.bottleneck * ((stage > 0) + (stage < num_stages - 1))
        costs.append(float(max(cost, 1)))
    mean = sum(costs) / num_stages
    return [c / mean for c in costs]


def capacities(peers: Sequence[PeerLoad], num_stages: int) -> list[float]:
    """Each stage's capacity in samples per second: the sum of its peers' throughputs."""
    total = [0.0] * num_stages
    for peer in peers:
        if 0 <= peer.stage < num_stages:
            total[peer.stage] += peer.throughput
    return total


def _costs(costs: Sequence[float] | None, num_stages: int) -> list[float]:
    if costs is None:
        return [1.0] * num_stages
    if len(costs) != num_stages or min(costs) <= 0:
        raise ValueError(f"stage costs must be {num_stages} positive numbers, got {list(costs)}")
    return list(costs)


def bottleneck(caps: Sequence[float], queues: Sequence[int] | None = None) -> int:
    """The stage with the least capacity; among equals, the longest queue, then the lowest index."""
    queues = queues or [0] * len(caps)
    return min(range(len(caps)), key=lambda s: (caps[s], -queues[s], s))


def _improves(low_after: float, low_before: float, margin: float, speed: float) -> bool:
    """Whether a move gains more than `margin` of the moving peer's own throughput.

    Hysteresis in units of the mover: a move costs about the mover's throughput for as long as it
    downloads the new stage's state, so small gains are not worth it; and, unlike a margin relative
    to the stage's capacity, it does not freeze a large swarm where one peer is a small share.
    """
    return low_after - low_before > margin * speed


def plan_moves(
    peers: Sequence[PeerLoad],
    num_stages: int,
    margin: float = 0.5,
    costs: Sequence[float] | None = None,
    max_moves: int | None = None,
) -> list[Move]:
    """The moves that the rule makes from this view, in order, each judged after the ones before it.

    Every peer that reads the same view computes the same plan, so peers act on it at once without
    talking: a peer carries out its own move, if it has one. Each step moves, to the current
    bottleneck, the peer whose move lifts the lower of the two stages highest; when no single move
    does, two peers trade places (a faster one to the bottleneck, a slower one back), judged alike.
    A stage always keeps a serving peer that is not moving: peers arriving by the same plan hold no
    state until they have downloaded it, so they cannot stand in for it.
    """
    cost = _costs(costs, num_stages)
    placed = {p.peer_id: p for p in peers if 0 <= p.stage < num_stages}
    caps = capacities(list(placed.values()), num_stages)
    queues = [0] * num_stages
    holders = [0] * num_stages  # serving peers that stay: they keep the stage's state alive
    for p in placed.values():
        queues[p.stage] += p.queue_length
        holders[p.stage] += p.serving
    moved: set[str] = set()
    plan: list[Move] = []
    while max_moves is None or len(plan) < max_moves:
        target = bottleneck(caps, queues)
        best: tuple[float, str] | None = None
        for p in placed.values():
            # a peer moves once per plan; a joiner holds no state yet, so it has none to move
            if p.peer_id in moved or not (p.serving and p.movable) or p.stage == target or holders[p.stage] < 2:
                continue
            speed = p.throughput * cost[p.stage] / cost[target]
            low_after = min(caps[target] + speed, caps[p.stage] - p.throughput)
            if _improves(low_after, caps[target], margin, speed) and (best is None or (low_after, p.peer_id) > best):
                best = (low_after, p.peer_id)
        if best is not None:
            chosen = [(placed[best[1]], target)]
        else:
            # no single move helps: a faster peer of a donor may trade places with a slower one here
            swap = _best_swap(placed, moved, holders, caps, target, cost, margin)
            if swap is None:
                break
            chosen = swap
        low_before = caps[target]
        for p, to in chosen:
            speed = p.throughput * cost[p.stage] / cost[to]
            caps[p.stage] -= p.throughput
            caps[to] += speed
            holders[p.stage] -= 1
            placed[p.peer_id] = PeerLoad(p.peer_id, to, speed, True)
            moved.add(p.peer_id)
        low_after = min(caps[target], *(caps[p.stage] for p, _ in chosen))
        plan += [Move(p.peer_id, p.stage, to, low_before, low_after) for p, to in chosen]
        queues = [0] * num_stages  # queues describe the view before any move
    return plan


def _best_swap(
    placed: dict[str, PeerLoad],
    moved: set[str],
    holders: list[int],
    caps: list[float],
    target: int,
    cost: list[float],
    margin: float,
) -> list[tuple[PeerLoad, int]] | None:
    """The exchange of a donor's peer with one of the bottleneck's that lifts the lower of the two stages most."""
    if holders[target] < 2:
        return None
    here = [p for p in placed.values() if p.stage == target and p.serving and p.movable and p.peer_id not in moved]
    best: tuple[float, str, str] | None = None
    for a in placed.values():
        if a.stage == target or not (a.serving and a.movable) or a.peer_id in moved or holders[a.stage] < 2:
            continue
        d = a.stage
        for b in here:
            to_target = a.throughput * cost[d] / cost[target]
            to_donor = b.throughput * cost[target] / cost[d]
            if to_target <= b.throughput:
                continue  # only a faster peer for the bottleneck can help it
            low_after = min(caps[target] - b.throughput + to_target, caps[d] - a.throughput + to_donor)
            if _improves(low_after, caps[target], margin, to_target) and (
                best is None or (low_after, a.peer_id, b.peer_id) > best
            ):
                best = (low_after, a.peer_id, b.peer_id)
    if best is None:
        return None
    a, b = placed[best[1]], placed[best[2]]
    return [(a, target), (b, a.stage)]


def choose_stage(
    peers: Sequence[PeerLoad],
    num_stages: int,
    costs: Sequence[float] | None = None,
    rng: random.Random | None = None,
) -> int:
    """The stage a newcomer should join: the bottleneck, where added capacity raises the throughput.

    Stages tied at the minimum (an empty swarm: all of them) are chosen among at random, so that
    peers starting together spread out instead of piling onto stage 0. Capacities are compared in
    time per sample, so a stage that costs twice as much needs twice the throughput.
    """
    rng = rng or random.Random()
    cost = _costs(costs, num_stages)
    caps = capacities(peers, num_stages)
    # a newcomer's throughput on stage s is inversely proportional to its cost: compare caps * cost
    weighted = [caps[s] * cost[s] for s in range(num_stages)]
    low = min(weighted)
    tied = [s for s in range(num_stages) if weighted[s] <= low * (1 + 1e-9)]
    return rng.choice(tied)


def assignment_throughput(
    speeds: Sequence[float], stages: Sequence[int], num_stages: int, costs: Sequence[float] | None = None
) -> float:
    """Throughput of peers with unit-cost `speeds` placed on `stages`: the least stage capacity."""
    cost = _costs(costs, num_stages)
    caps = [0.0] * num_stages
    for speed, stage in zip(speeds, stages):
        caps[stage] += speed / cost[stage]
    return min(caps)


def upper_bound_throughput(speeds: Sequence[float], num_stages: int, costs: Sequence[float] | None = None) -> float:
    """No assignment beats the total speed spread perfectly: sum(speeds) / sum(costs)."""
    return sum(speeds) / sum(_costs(costs, num_stages))


def greedy_assignment(speeds: Sequence[float], num_stages: int, costs: Sequence[float] | None = None) -> list[int]:
    """Fastest peer first, each to the stage with the least capacity so far: a good start, not optimal."""
    cost = _costs(costs, num_stages)
    caps = [0.0] * num_stages
    stages = [0] * len(speeds)
    for i in sorted(range(len(speeds)), key=lambda i: -speeds[i]):
        s = min(range(num_stages), key=lambda s: (caps[s], s))
        stages[i] = s
        caps[s] += speeds[i] / cost[s]
    return stages


def ideal_assignment(
    speeds: Sequence[float],
    num_stages: int,
    costs: Sequence[float] | None = None,
    node_limit: int = 2_000_000,
    max_exact_peers: int = 500,
) -> tuple[float, list[int], bool]:
    """The best assignment of peers with unit-cost `speeds` to stages: (throughput, stages, proven).

    Exact by branch and bound: start from the greedy assignment, then search for one strictly
    better until none exists. `proven` is False only when the search ran past `node_limit` nodes
    (thousands of peers); the result is then the best found, within the gap to the upper bound.
    """
    cost = _costs(costs, num_stages)
    order = sorted(range(len(speeds)), key=lambda i: -speeds[i])
    sorted_speeds = [speeds[i] for i in order]
    suffix = [0.0] * (len(order) + 1)
    for k in range(len(order) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + sorted_speeds[k]
    best_stages = greedy_assignment(speeds, num_stages, cost)
    best = assignment_throughput(speeds, best_stages, num_stages, cost)
    bound = upper_bound_throughput(speeds, num_stages, cost)
    if len(set(cost)) == 1 and all(float(v).is_integer() for v in speeds):
        bound = math.floor(sum(speeds) / num_stages + 1e-9) / cost[0]  # integer speeds: integer capacities
    if best >= bound * (1 - 1e-12):
        return best, best_stages, True
    if len(speeds) > max_exact_peers:
        return best, best_stages, False
    groups = [[s for s in range(num_stages) if cost[s] == c] for c in sorted(set(cost))]
    nodes = 0

    def cover(target: float) -> list[int] | None:
        """Stages for the sorted peers giving every stage at least `target`, or None if impossible."""
        nonlocal nodes
        need = [target * c for c in cost]
        chosen = [0] * len(order)
        failed: set[tuple] = set()

        def place(k: int) -> bool:
            nonlocal nodes
            nodes += 1
            if nodes > node_limit:
                raise TimeoutError
            open_needs = [n for n in need if n > 1e-12]
            if not open_needs:
                for j in range(k, len(order)):
                    chosen[j] = 0
                return True
            if suffix[k] < sum(open_needs) - 1e-12:
                return False
            # stages of equal cost are interchangeable: their needs are compared as a sorted tuple
            key = (k, *(tuple(sorted(round(need[s], 9) for s in group)) for group in groups))
            if key in failed:
                return False
            tried: set[tuple[float, float]] = set()
            for s in range(num_stages):
                if need[s] <= 1e-12 or (need[s], cost[s]) in tried:
                    continue  # a stage equal to one tried already leads to the same outcomes
                tried.add((need[s], cost[s]))
                need[s] -= sorted_speeds[k]
                chosen[k] = s
                done = place(k + 1)
                need[s] += sorted_speeds[k]
                if done:
                    return True
            # (leaving a peer out is never better: covering only gets easier with more capacity)
            failed.add(key)
            return False

        return list(chosen) if place(0) else None

    proven = True
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, len(speeds) + 200))  # the search recurses once per peer
    try:
        while True:
            found = cover(best * (1 + 1e-9) + 1e-12)
            if found is None:
                break
            stages = [0] * len(speeds)
            for k, i in enumerate(order):
                stages[i] = found[k]
            value = assignment_throughput(speeds, stages, num_stages, cost)
            if value <= best:
                break
            best, best_stages = value, stages
    except TimeoutError:
        proven = False
    finally:
        sys.setrecursionlimit(limit)
    return best, best_stages, proven
