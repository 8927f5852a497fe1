"""The balance rule: which stage a newcomer joins, and which peers move to the bottleneck. Pure.

A pipeline runs no faster than its slowest stage, so the swarm's throughput is the minimum over
stages of their capacity, a stage's capacity being the summed throughput of its peers. Every peer
reads the same announcements, so every peer can compute the same plan and carry out its own part.

A move takes a peer from a donor stage to the bottleneck. It is made only if it raises the
capacity of the lower of the two stages by more than a hysteresis margin (a fraction of the moving
peer's own throughput) and by more than it costs (`MoveCost`: the state download and the
averaging it disturbs, against the time its gain is counted for): the bottleneck must gain and the
donor must not fall to where the bottleneck was. The gain must also be real, not noise: the
capacities compared are sums of measured speeds, each with a measured spread (`PeerLoad.spread`),
so the donor, less its mover, must exceed the bottleneck by `deviations` standard deviations of the
difference of the two sums. Under noise a stage looks lower than its twin half of the time; a move
on such a look would have the next look move a peer back. A stage with no capacity at all is filled first,
whatever the margin or the cost: until it is, the swarm trains nothing. When the bottleneck was the
only stage at the minimum, the swarm's throughput rises; when several stages tie, one fewer sits at
the minimum and the next move can lift the rest. Two stages with equal loads never trade a peer
back and forth (the donor would end lower than the bottleneck started), and a donor keeps at least
one serving peer, so no stage is ever left empty.

A plan is whole: every move the rule makes from one view, in order. A mover announces LEAVING
naming its target, and counts there in everyone's view while on its way, so the plan computed
after some of its moves have started is the rest of the same plan, and all of its moves can be
taken within one period.

Peers differ in speed and stages in cost (a stage with more layers takes longer per sample), so a
peer's throughput on another stage is estimated as its throughput on its own, scaled by the ratio
of the two stages' costs.
"""

from __future__ import annotations

import bisect
import math
import random
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from swarm.models.gpt import partition_layers
from swarm.models.registry import ModelSpec
from swarm.policy.claim_bounds import believed_claims
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord


@dataclass(frozen=True)
class PeerLoad:
    """What the balance rule needs to know of one peer."""

    peer_id: str
    stage: int
    throughput: float  # samples per second on its stage
    serving: bool = True  # False: joining, so it adds capacity but holds no state to keep a stage alive
    queue_length: int = 0
    movable: bool = True  # False: it never rebalances, so no plan may count on moving it
    spread: float = 0.0  # standard deviation of its measured throughput, samples/s (0: taken as exact)


@dataclass(frozen=True)
class Move:
    """One peer leaving `source` for `target`, with the capacity of the lower of the two before and after."""

    peer_id: str
    source: int
    target: int
    low_before: float
    low_after: float


# seconds a move within a run takes besides the state download: drain, hand over, build, time a batch
MOVE_FIXED_SECONDS = 5.0

# how many standard deviations of the noise in two stages' measured capacities a move must clear: one
# sided, a donor that clears 2 is truly the richer of the two about 98 times in 100
NOISE_DEVIATIONS = 2.0


def loads_from_records(
    records: dict[int, list[StageRecord]],
    costs: Sequence[float] | None = None,
    spreads: Mapping[str, float] | None = None,
) -> list[PeerLoad]:
    """The peers that count toward capacity: serving ones, joining ones (about to serve), and movers.

    Each claimed throughput counts within its stage's bound (`swarm.policy.claim_bounds`).

    `spreads`: each peer's relative spread of measured throughput (`swarm.policy.held_records`), which
    makes its `PeerLoad.spread`; a peer missing there is taken as measured exactly.

    A mover announces LEAVING on its source with the stage it is `moving_to`: it counts there, as a
    joiner does (capacity, but no state to keep the stage alive), scaled by the two stages' `costs`,
    so that the rest of the plan that sent it is still the plan while it is on its way. A peer with
    records on two stages (the LEAVING one outlives its move by up to a TTL) counts where it serves
    or joins.
    """
    loads: dict[str, PeerLoad] = {}
    moving: dict[str, PeerLoad] = {}
    for stage, found in records.items():
        for r in found:
            if r.stage != stage:
                continue
            throughput = max(float(r.throughput), 0.0)
            if r.state in (SERVING, JOINING):
                current = loads.get(r.peer_id)
                if current is None or (r.state == SERVING and not current.serving):
                    loads[r.peer_id] = PeerLoad(
                        r.peer_id, stage, throughput, r.state == SERVING, r.queue_length, r.movable
                    )
            elif r.state == LEAVING and 0 <= r.moving_to != stage and r.moving_to < r.num_stages:
                if costs is not None and max(stage, r.moving_to) < len(costs):
                    throughput *= costs[stage] / costs[r.moving_to]
                moving[r.peer_id] = PeerLoad(r.peer_id, r.moving_to, throughput, False, 0, r.movable)
    for peer_id, load in moving.items():
        loads.setdefault(peer_id, load)
    loads = _believed(loads)
    if not spreads:
        return list(loads.values())
    return [
        PeerLoad(p.peer_id, p.stage, p.throughput, p.serving, p.queue_length, p.movable, p.throughput * spread)
        if (spread := spreads.get(p.peer_id, 0.0))
        else p
        for p in loads.values()
    ]


def _believed(loads: dict[str, PeerLoad]) -> dict[str, PeerLoad]:
    """The loads with each claimed throughput bounded by its stage's (`swarm.policy.claim_bounds`)."""
    believed = believed_claims((p, load.stage, load.throughput) for p, load in loads.items())
    return {
        p: load if believed[p] == load.throughput else replace(load, throughput=believed[p])
        for p, load in loads.items()
    }


def stage_costs(spec: ModelSpec, num_stages: int) -> list[float]:
    """Relative compute per sample of each stage (mean 1), from the matrix multiplications it holds."""
    d, layers = spec.d_model, partition_layers(spec.n_layer, num_stages, spec.stage_blocks)
    # projections (those writing the residual stream are narrower with a subspace), then attention scores
    per_block = (3 + spec.mlp_ratio) * d * d + (1 + spec.mlp_ratio) * d * spec.learned_width + 2 * spec.seq_len * d
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


@dataclass(frozen=True)
class MoveCost:
    """What a move costs and how long its gain is counted for, in seconds; the same for every peer.

    While it moves, the mover serves nothing: it drains its queue, rebuilds and downloads the target's
    state (`transfer_seconds`). Its move also takes serving time from others (`averaging_seconds`): the
    source's averaging round waits for its hand-over and the target's mates upload its state. A move
    pays if what it adds to the lower of its two stages, from when it serves until `horizon_seconds`
    after the plan (the time until the next plan: after that the swarm is judged afresh), exceeds the
    mover's throughput over those seconds. Every peer derives it from the model and the shared flags,
    never from what it alone measured, so that every peer still computes the same plan.
    """

    transfer_seconds: float = 0.0
    averaging_seconds: float = 0.0
    horizon_seconds: float = math.inf

    @classmethod
    def of_state(cls, state_mb: float, bandwidth_mbit: float, fixed_seconds: float, horizon_seconds: float) -> MoveCost:
        """A move that downloads `state_mb` over `bandwidth_mbit` after `fixed_seconds` of leaving and rebuilding;
        the target's mates upload as much, which is the averaging it disturbs there."""
        download = state_mb * 8 / bandwidth_mbit if bandwidth_mbit > 0 else math.inf
        return cls(fixed_seconds + download, download, horizon_seconds)

    def least_gain(self) -> float:
        """The least gain that pays for a move, as a fraction of the mover's throughput on its target."""
        spent = max(self.transfer_seconds, 0.0) + max(self.averaging_seconds, 0.0)
        if spent <= 0:
            return 0.0
        earning = self.horizon_seconds - max(self.transfer_seconds, 0.0)
        return spent / earning if earning > 0 else math.inf


class _Movers:
    """The peers each stage may give away, sorted by (throughput, peer id), with their throughputs to search."""

    def __init__(self, placed: dict[str, PeerLoad], num_stages: int) -> None:
        self.ids: list[list[str]] = [[] for _ in range(num_stages)]
        self.speeds: list[list[float]] = [[] for _ in range(num_stages)]
        self.spreads: list[list[float]] = [[] for _ in range(num_stages)]
        pairs: list[list[tuple[float, str, float]]] = [[] for _ in range(num_stages)]
        for p in placed.values():
            if p.serving and p.movable:  # a joiner holds no state yet, so it has none to move
                pairs[p.stage].append((p.throughput, p.peer_id, p.spread))
        for stage, found in enumerate(pairs):
            found.sort()
            self.speeds[stage] = [speed for speed, _, _ in found]
            self.ids[stage] = [peer_id for _, peer_id, _ in found]
            self.spreads[stage] = [spread for _, _, spread in found]

    def near(self, stage: int, speed: float) -> list[int]:
        """Indices of the nearest peers at or below `speed` and above it (the last of equal speeds: the largest id)."""
        speeds = self.speeds[stage]
        above = bisect.bisect_right(speeds, speed)
        found = [above - 1] if above > 0 else []
        if above < len(speeds):
            found.append(bisect.bisect_right(speeds, speeds[above]) - 1)
        return found

    def free(self, stage: int, index: int, target: int, bars: Mapping[str, frozenset[int]]) -> int | None:
        """`index`, or the nearest slower peer of `stage` not barred from `target`, if the peer at it is."""
        while index >= 0 and target in bars.get(self.ids[stage][index], ()):
            index -= 1
        return index if index >= 0 else None

    def below(self, stage: int, speed: float) -> int | None:
        """Index of the fastest peer strictly slower than `speed` (the last of equal speeds), if any."""
        index = bisect.bisect_left(self.speeds[stage], speed) - 1
        return index if index >= 0 else None

    def remove(self, stage: int, index: int) -> None:
        del self.speeds[stage][index]
        del self.ids[stage][index]
        del self.spreads[stage][index]


def _canonical(p: PeerLoad) -> tuple:
    return (p.peer_id, p.stage, p.throughput, p.serving, p.movable, p.queue_length, p.spread)


@dataclass
class _Stages:
    """What a plan tracks of each stage as its moves are taken: capacity, its noise, and who holds its state."""

    caps: list[float]
    variances: list[float]  # of the capacity: the sum of its peers' squared spreads (their noise is independent)
    holders: list[int]  # serving peers that stay: they keep the stage's state alive
    cost: list[float]
    deviations: float

    def noise(self, donor: int, target: int, leaving_spread: float = 0.0) -> float:
        """Standard deviation of the difference of the donor's capacity, less a mover, and the target's."""
        return math.sqrt(max(self.variances[donor] - leaving_spread**2, 0.0) + self.variances[target])


def plan_moves(
    peers: Sequence[PeerLoad],
    num_stages: int,
    margin: float = 0.5,
    costs: Sequence[float] | None = None,
    max_moves: int | None = None,
    move_cost: MoveCost | None = None,
    deviations: float = NOISE_DEVIATIONS,
    barred: Mapping[str, Collection[int]] | None = None,
) -> list[Move]:
    """The moves that the rule makes from this view, in order, each judged after the ones before it.

    Every peer that reads the same view computes the same plan (the peers are taken in the order of
    their ids, whatever order the view lists them in), so peers act on it at once without talking:
    a peer carries out its own move, if it has one. Each step moves, to the current bottleneck, the
    peer whose move lifts the lower of the two stages highest; when no single move does, two peers
    trade places (a faster one to the bottleneck, a slower one back), judged alike. A move must gain
    more than `margin` of the mover's throughput, and more than its `move_cost` (see `MoveCost`),
    except toward a stage with no capacity at all: the swarm trains nothing until that stage is
    filled, so it is filled first, whatever the cost. Every move, that one too, must leave the donor
    above the bottleneck's capacity by `deviations` standard deviations of their measured noise (the
    peers' `spread`). A stage always keeps a serving peer that is not moving: peers arriving by the
    same plan hold no state until they have downloaded it, so they cannot stand in for it.
    `barred`: stages a peer may not be moved to (the ones it left within its cool-down); the rule
    then moves another peer, or none.

    Cheap for large swarms: the best mover of a donor is one of the two whose throughput is nearest
    to where the donor's and the bottleneck's capacities would cross, found by bisection in the
    donor's peers sorted once by throughput, and donors are tried from the richest down only while
    they could still beat the best move found. 10,000 peers plan in tens of milliseconds.
    """
    least = max(margin, move_cost.least_gain() if move_cost is not None else 0.0)
    placed: dict[str, PeerLoad] = {}
    for p in sorted((p for p in peers if 0 <= p.stage < num_stages), key=_canonical):
        placed[p.peer_id] = p
    stages = _Stages([0.0] * num_stages, [0.0] * num_stages, [0] * num_stages, _costs(costs, num_stages), deviations)
    queues = [0] * num_stages
    for p in placed.values():
        stages.caps[p.stage] += max(p.throughput, 0.0)
        stages.variances[p.stage] += p.spread**2
        queues[p.stage] += p.queue_length
        stages.holders[p.stage] += p.serving
    movers = _Movers(placed, num_stages)
    bars = {peer_id: frozenset(found) for peer_id, found in (barred or {}).items() if found}
    plan: list[Move] = []
    caps, cost = stages.caps, stages.cost
    while max_moves is None or len(plan) < max_moves:
        target = bottleneck(caps, queues)
        need = 0.0 if caps[target] <= 0 else least  # an empty stage is filled first, whatever the cost
        donors = sorted(range(num_stages), key=lambda s: (-caps[s], s))
        chosen = _best_single(movers, donors, stages, target, need, bars)
        if chosen is None:
            # no single move helps: a faster peer of a donor may trade places with a slower one here
            chosen = _best_swap(movers, donors, stages, target, need, bars)
            if chosen is None:
                break
        low_before = caps[target]
        for stage, index, to in chosen:
            speed, spread = movers.speeds[stage][index], movers.spreads[stage][index]
            ratio = cost[stage] / cost[to]
            caps[stage] -= speed
            caps[to] += speed * ratio
            stages.variances[stage] = max(stages.variances[stage] - spread**2, 0.0)
            stages.variances[to] += (spread * ratio) ** 2
            stages.holders[stage] -= 1
        moves = [(movers.ids[stage][index], stage, to) for stage, index, to in chosen]
        for stage, index, _ in sorted(chosen, key=lambda c: -c[1]):
            movers.remove(stage, index)
        low_after = min(caps[target], *(caps[stage] for _, stage, _ in moves))
        plan += [Move(peer_id, stage, to, low_before, low_after) for peer_id, stage, to in moves]
        queues = [0] * num_stages  # queues describe the view before any move
    return plan


def _best_single(
    movers: _Movers,
    donors: list[int],
    stages: _Stages,
    target: int,
    need: float,
    bars: Mapping[str, frozenset[int]],
) -> list[tuple[int, int, int]] | None:
    """The move of one donor's peer to `target` that lifts the lower of the two highest: [(donor, index, target)]."""
    caps, cost, holders = stages.caps, stages.cost, stages.holders
    low_before = caps[target]
    best: tuple[float, str, int, int] | None = None
    for donor in donors:
        if best is not None and caps[donor] <= best[0]:
            break  # a donor ends below its capacity now: none of the poorer ones can do better
        if donor == target or holders[donor] < 2 or not movers.speeds[donor]:
            continue
        ratio = cost[donor] / cost[target]
        # min(low_before + speed * ratio, caps[donor] - speed) rises, then falls, in the mover's speed:
        # its best is at the peers nearest to where the two cross, on either side; the noise rule may
        # refuse both, when the fastest peer slow enough to leave the donor clearly above is the best
        crossing = (caps[donor] - low_before) / (1 + ratio)
        nearest = movers.near(donor, crossing)
        clear = movers.below(donor, caps[donor] - low_before - stages.deviations * stages.noise(donor, target))
        candidates = {movers.free(donor, i, target, bars) for i in (*nearest, *([] if clear is None else [clear]))}
        for index in sorted(i for i in candidates if i is not None):
            speed = movers.speeds[donor][index]
            gained = speed * ratio
            left = caps[donor] - speed
            low_after = min(low_before + gained, left)
            if low_after - low_before <= need * gained:
                continue
            if left - low_before <= stages.deviations * stages.noise(donor, target, movers.spreads[donor][index]):
                continue
            key = (low_after, movers.ids[donor][index], donor, index)
            if best is None or key[:2] > best[:2]:
                best = key
    return None if best is None else [(best[2], best[3], target)]


def _best_swap(
    movers: _Movers,
    donors: list[int],
    stages: _Stages,
    target: int,
    need: float,
    bars: Mapping[str, frozenset[int]],
) -> list[tuple[int, int, int]] | None:
    """The exchange of a donor's peer with one of `target`'s that lifts the lower of the two stages most.

    For each peer b of the target, the donor's best partner is again one of the two nearest to where
    the stages' capacities cross, so each donor is one vectorised bisection over the target's peers.
    """
    caps, cost, holders = stages.caps, stages.cost, stages.holders
    here = movers.speeds[target]
    if holders[target] < 2 or not here:
        return None
    low_before = caps[target]
    slow = np.asarray(here)
    best: tuple[float, str, str, int, int, int] | None = None
    for donor in donors:
        if best is not None and caps[donor] <= best[0]:
            break
        if donor == target or holders[donor] < 2 or not movers.speeds[donor]:
            continue
        fast = np.asarray(movers.speeds[donor])
        ratio = cost[donor] / cost[target]
        to_donor = slow * cost[target] / cost[donor]
        crossing = (caps[donor] - low_before + slow + to_donor) / (1 + ratio)
        above = np.searchsorted(fast, crossing, side="right")
        inside = np.minimum(above, len(fast) - 1)
        last_equal = np.searchsorted(fast, fast[inside], side="right") - 1
        # the noise of both whole stages, a little more than after the trade: a swap is the rule's finest step
        noise = stages.deviations * stages.noise(donor, target)
        for picks, valid in ((np.maximum(above - 1, 0), above > 0), (last_equal, above < len(fast))):
            speed = fast[picks]
            gained = speed * cost[donor] / cost[target]
            left = caps[donor] - speed + to_donor
            low_after = np.minimum(low_before - slow + gained, left)
            # only a faster peer for the bottleneck can help it
            ok = valid & (gained > slow) & (low_after - low_before > need * gained) & (left - low_before > noise)
            if not ok.any():
                continue
            top = float(low_after[ok].max())
            if best is not None and top < best[0]:
                continue
            for b in np.flatnonzero(ok & (low_after == top)):
                a = int(picks[b])
                fast_id, slow_id = movers.ids[donor][a], movers.ids[target][int(b)]
                if target in bars.get(fast_id, ()) or donor in bars.get(slow_id, ()):
                    continue
                key = (top, fast_id, slow_id, donor, a, int(b))
                if best is None or key[:3] > best[:3]:
                    best = key
    if best is None:
        return None
    _, _, _, donor, a, b = best
    return [(donor, a, target), (target, b, donor)]


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
    best_stages = greedy_assignment(speeds, num_stages, cost)
    best = assignment_throughput(speeds, best_stages, num_stages, cost)
    bound = upper_bound_throughput(speeds, num_stages, cost)
    if len(set(cost)) == 1 and all(float(v).is_integer() for v in speeds):
        bound = math.floor(sum(speeds) / num_stages + 1e-9) / cost[0]  # integer speeds: integer capacities
    if best >= bound * (1 - 1e-12):
        return best, best_stages, True
    if len(speeds) > max_exact_peers:
        return best, best_stages, False
    search = _CoverSearch(speeds, num_stages, cost, node_limit)
    proven = True
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, len(speeds) + 200))  # the search recurses once per peer
    try:
        while True:
            stages = search.cover(best * (1 + 1e-9) + 1e-12)
            if stages is None:
                break
            value = assignment_throughput(speeds, stages, num_stages, cost)
            if value <= best:
                break
            best, best_stages = value, stages
    except TimeoutError:
        proven = False
    finally:
        sys.setrecursionlimit(limit)
    return best, best_stages, proven


class _CoverSearch:
    """The branch and bound of `ideal_assignment`: peers placed fastest first so that every stage gets at
    least a target capacity. Its nodes count over every search it makes; past `node_limit`, TimeoutError."""

    def __init__(self, speeds: Sequence[float], num_stages: int, cost: list[float], node_limit: int) -> None:
        self.num_stages = num_stages
        self.cost = cost
        self.node_limit = node_limit
        self.order = sorted(range(len(speeds)), key=lambda i: -speeds[i])
        self.sorted_speeds = [speeds[i] for i in self.order]
        self.suffix = [0.0] * (len(self.order) + 1)  # the speed of the peers from k on
        for k in range(len(self.order) - 1, -1, -1):
            self.suffix[k] = self.suffix[k + 1] + self.sorted_speeds[k]
        self.groups = [[s for s in range(num_stages) if cost[s] == c] for c in sorted(set(cost))]
        self.nodes = 0

    def cover(self, target: float) -> list[int] | None:
        """Stages for the peers (in their given order) giving every stage at least `target`, or None if impossible."""
        num_stages, cost, node_limit, groups = self.num_stages, self.cost, self.node_limit, self.groups
        order, sorted_speeds, suffix = self.order, self.sorted_speeds, self.suffix
        need = [target * c for c in cost]
        chosen = [0] * len(order)
        failed: set[tuple] = set()

        def place(k: int) -> bool:
            self.nodes += 1
            if self.nodes > node_limit:
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

        if not place(0):
            return None
        stages = [0] * len(order)
        for k, i in enumerate(order):
            stages[i] = chosen[k]
        return stages
