"""A plan run as events: trainers' microbatches queue for links and devices, as the swarm's calls do.

Where `swarm.planning.pipeline_model` predicts a plan's samples/s in closed form, this runs it: each
trainer keeps its window of microbatches in flight; each microbatch calls every stage forward, then
backward in reverse, at the peer of the stage whose call would end first, ties within a tenth broken at
random (as `swarm.policy.router.Router.choose` picks); every call sends its request out of the trainer's
link at its speed and into the peer's at the narrower of the peer's and the regions' (each direction of
each link a queue of its own), waits half a round trip, queues for the peer's device, and sends its
reply back the same way. With each microbatch done, every peer with mates spends that microbatch's share
of its step's averaging time on its link, delaying the calls queued behind. Queueing, the window and the
links then set the pace, not a formula, so the two can be held against each other, and plans compared by
what they do rather than what is predicted.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

from swarm.planning.pipeline_model import LinkView, Plan, averaging_seconds, fits, predict, stage_bytes


@dataclass
class _Queue:
    """A device or one direction of a link: work starts when it is free, in arrival order."""

    free_at: float = 0.0

    def take(self, now: float, seconds: float) -> float:
        start = max(now, self.free_at)
        self.free_at = start + seconds
        return self.free_at


def simulate_plan(
    plan: Plan, view: LinkView, microbatches: int = 0, seed: int = 0, windows: tuple[int, ...] | None = None
) -> float:
    """Samples/s the plan delivers over `microbatches` per trainer (0: 20 windows' worth, 1,000 at least; the
    first quarter, filling the pipeline, left out), each trainer keeping the plan's window in flight (or
    `windows`); 0 if a stage has no peer that holds it."""
    cluster, m, num_stages = view.cluster, plan.microbatch, plan.num_stages
    prediction = predict(plan, view)
    windows = windows or prediction.windows
    microbatches = microbatches or max(1000, 20 * max(windows))
    members = [
        [
            i
            for i, s in enumerate(plan.stages)
            if s == stage and fits(cluster, i, num_stages, stage, plan.blocks[stage], m)
        ]
        for stage in range(num_stages)
    ]
    if not all(members):
        return 0.0
    rng = random.Random(seed)
    peer_in = [_Queue() for _ in cluster.peers]
    peer_out = [_Queue() for _ in cluster.peers]
    device = [_Queue() for _ in cluster.peers]
    trainer_in = [_Queue() for _ in cluster.trainers]
    trainer_out = [_Queue() for _ in cluster.trainers]
    # a call's cost at each peer of its stage: device time and its link's share, as the router times peers
    costs = [{i: _call_cost(view, plan, i, s) for i in group} for s, group in enumerate(members)]
    service = {(i, s): _forward_backward(view, plan, i, s) for s, group in enumerate(members) for i in group}
    events: list[tuple[float, int, int, int]] = []  # (time, serial, trainer, call index)
    serial = itertools.count()
    done = [0] * len(cluster.trainers)
    started = [0] * len(cluster.trainers)
    marks: list[tuple[float, int]] = []  # (time, samples done so far), per completion
    samples_done = 0
    for t, window in enumerate(windows):
        for _ in range(min(window, microbatches)):
            started[t] += 1
            heapq.heappush(events, (0.0, next(serial), t, 0))
    while events:
        now, _, t, call = heapq.heappop(events)
        if call == 2 * num_stages:  # the microbatch's last backward came back
            done[t] += 1
            samples_done += m
            marks.append((now, samples_done))
            _average(view, plan, members, peer_in, peer_out, now, m / cluster.target_batch_size)
            if started[t] < microbatches:
                started[t] += 1
                heapq.heappush(events, (now, next(serial), t, 0))
            continue
        stage = call if call < num_stages else 2 * num_stages - 1 - call
        peer = _route(members[stage], costs[stage], device, peer_in, now, rng)
        finish = _call(view, plan, t, peer, stage, call >= num_stages, now, (trainer_out[t], trainer_in[t]),
                       device[peer], (peer_out[peer], peer_in[peer]), service[peer, stage])  # fmt: skip
        heapq.heappush(events, (finish, next(serial), t, call + 1))
    start = next((time for time, samples in marks if samples >= len(marks) * m // 4), 0.0)
    steady = [(time, samples) for time, samples in marks if time >= start]
    if len(steady) < 2 or steady[-1][0] <= steady[0][0]:
        return 0.0
    return (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])


def _call_cost(view: LinkView, plan: Plan, peer: int, stage: int) -> float:
    """Seconds one call holds `peer`, on average: half its device time and half its inbound transfers."""
    inward, outward = stage_bytes(view.cluster, plan.num_stages, stage)
    wire = plan.microbatch * (2 * inward + outward) * view.peer_ratio[peer] / view.peer_bandwidth[peer]
    return (sum(_forward_backward(view, plan, peer, stage)) + wire) / 2


def _route(
    group: list[int], costs: dict[int, float], device: list[_Queue], link: list[_Queue], now: float, rng: random.Random
) -> int:
    """The peer whose call would end first (its device and inbound link busy until then, plus the call), ties within
    a tenth of the best broken at random: the rule of `swarm.policy.router.Router.choose`."""
    ends = {i: max(now, device[i].free_at, link[i].free_at) + costs[i] for i in group}
    best = min(ends.values())
    return rng.choice([i for i in group if ends[i] - now <= 1.1 * (best - now)])


def _forward_backward(view: LinkView, plan: Plan, peer: int, stage: int) -> tuple[float, float]:
    """Device seconds of one microbatch's forward call and backward call at `peer` (a quarter and three quarters
    of its flops, each with one call's overhead and its share of the coding)."""
    cluster, m = view.cluster, plan.microbatch
    inward, outward = stage_bytes(cluster, plan.num_stages, stage)
    flops = cluster.model.stage_flops(plan.blocks[stage], stage == 0, stage == plan.num_stages - 1)
    seconds = m * flops / cluster.peers[peer].flops
    coding = m * view.peer_coding[peer]
    forward = seconds / 4 + coding * (inward + outward) + cluster.call_overhead
    backward = 3 * seconds / 4 + coding * (2 * inward + outward) + cluster.call_overhead
    return forward, backward


def _call(
    view: LinkView,
    plan: Plan,
    trainer: int,
    peer: int,
    stage: int,
    backward: bool,
    now: float,
    trainer_link: tuple[_Queue, _Queue],
    device: _Queue,
    peer_link: tuple[_Queue, _Queue],
    service: tuple[float, float],
) -> float:
    """When one call's reply is back at the trainer: the request leaves the trainer's link (at its own speed) and
    enters the peer's (at the narrower of the peer's and the regions' link), half a round trip, the device (`service`:
    forward and backward seconds), and the reply back the other way. Each link is (out, in)."""
    m, ratio = plan.microbatch, view.ratio[trainer][peer]
    inward, outward = stage_bytes(view.cluster, plan.num_stages, stage)
    sent, returned = (inward + outward, inward) if backward else (inward, outward)
    near, far = view.cluster.trainers[trainer].bandwidth, view.bandwidth[trainer][peer]
    half_trip = view.round_trip[trainer][peer] / 2
    request, reply = m * sent * ratio, m * returned * ratio
    arrive = max(trainer_link[0].take(now, request / near), peer_link[1].take(now, request / far)) + half_trip
    computed = device.take(arrive, service[1 if backward else 0])
    back = max(peer_link[0].take(computed, reply / far), trainer_link[1].take(computed, reply / near))
    return back + half_trip


def _average(
    view: LinkView,
    plan: Plan,
    members: list[list[int]],
    peer_in: list[_Queue],
    peer_out: list[_Queue],
    now: float,
    share: float,
) -> None:
    """A microbatch's `share` of a step: every peer of a stage with mates spends that share of its averaging time
    on both directions of its link (TCP shares a link between flows; a whole round at once would stall the calls
    behind it, which the averaging's own chunks do not)."""
    for stage, group in enumerate(members):
        for peer in group:
            seconds = averaging_seconds(
                view.cluster, plan.num_stages, stage, plan.blocks[stage], len(group), view.peer_bandwidth[peer]
            )
            if seconds > 0:
                peer_in[peer].take(now, seconds * share)
                peer_out[peer].take(now, seconds * share)
