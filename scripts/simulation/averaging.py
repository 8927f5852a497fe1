"""The averaging round of a stage's mates, as the simulation models it: its bytes, its time, and what it holds up.

A stage steps when its serving peers together have run `target_batch_size` samples of backward
work. Then its mates average their gradients the way `swarm.peer.averaging_round` does, a
reduce-scatter then an all-gather: each of the n mates exchanges small metadata in two phases
(offer, commit: two one-way latencies), sends (n-1)/n of a gradient in the scatter and receives as
much in the gather (two more latencies), and sums the n-1 slices it receives. So a round moves
about 2 (n-1)/n gradient sizes per peer and takes about

    4 * latency + 2 (n-1)/n * G / bandwidth + (n-1)/n * G / SUM_BYTES_PER_SECOND

with the latency and bandwidth of the slowest mate's link (every mate waits for the slowest
slice). G is the stage's gradient: 4 bytes per parameter. Each peer has a link of its own, its
bandwidth and one-way latency drawn uniformly in the scenario's ranges.

As peers do, a mate keeps serving through its stage's round (forwards and backwards of the next step
flow while it runs), and waits only when a step comes due while the previous round still runs (one
step of overlap, as `--overlap-steps`): the round then costs time only where it is longer than a step.
Without `serve_during_rounds` (the round before peers served through it), a mate serves nothing while
its stage averages: it finishes the call it is running, the round starts once every mate has (the
slowest decides), and none of them starts a queued call until the round is over. A round that comes
due while one runs starts after it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from simulation.actors import SimPeer
from simulation.scenario import SimConfig

SUM_BYTES_PER_SECOND = 2e9  # a CPU summing float32 slices: memory bound, a few GB/s
GRADIENT_BYTES_PER_PARAMETER = 4


@dataclass(frozen=True)
class Link:
    """A peer's network link: bandwidth in Mbit/s and one-way latency in seconds."""

    mbit: float
    latency: float


def round_seconds(gradient_bytes: float, links: list[Link]) -> float:
    """Seconds one round of n = len(links) mates takes: 0 for a peer alone (it steps without a round)."""
    n = len(links)
    if n < 2:
        return 0.0
    share = (n - 1) / n
    slowest_mbit = min(link.mbit for link in links)
    latency = max(link.latency for link in links)
    return (
        4 * latency
        + 2 * share * gradient_bytes * 8 / (slowest_mbit * 1e6)
        + share * gradient_bytes / SUM_BYTES_PER_SECOND
    )


class AveragingModel:
    """Per stage: the samples accumulated toward the next step, the rounds it ran, and their tallies."""

    def __init__(self, config: SimConfig, costs: list[float], rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        params = config.stage_params if config.stage_params else config.state_mb * 2**20 / 12  # params + 2 moments
        mean_cost = sum(costs) / len(costs)
        self.gradient_bytes = [GRADIENT_BYTES_PER_PARAMETER * params * c / mean_cost for c in costs]
        self.links: dict[str, Link] = {}
        self.accumulated = [0] * len(costs)
        self.round_end = [0.0] * len(costs)
        # (start, seconds, mates, bytes per peer, seconds its mates were held from serving) of every round
        self.rounds: list[list[tuple[float, float, int, float, float]]] = [[] for _ in costs]

    @property
    def enabled(self) -> bool:
        """Whether averaging is modelled at all (a positive target batch size)."""
        return self.config.target_batch_size > 0

    def link(self, peer_id: str) -> Link:
        """The peer's link, drawn the first time it is asked for."""
        if peer_id not in self.links:
            c = self.config
            self.links[peer_id] = Link(
                self.rng.uniform(c.link_mbit_min, c.link_mbit_max),
                self.rng.uniform(c.latency_ms_min, c.latency_ms_max) / 1e3,
            )
        return self.links[peer_id]

    def add(self, stage: int, samples: int) -> bool:
        """Backward samples run on `stage`; True when they complete a step, so a round is due."""
        self.accumulated[stage] += samples
        if self.accumulated[stage] < self.config.target_batch_size:
            return False
        self.accumulated[stage] -= self.config.target_batch_size
        return True

    def start_round(self, stage: int, mates: list[SimPeer], now: float) -> float:
        """A round of `mates` on `stage` comes due now: when it ends; the mates are held until then."""
        links = [self.link(p.peer_id) for p in mates]
        seconds = round_seconds(self.gradient_bytes[stage], links)
        # it starts once every mate has finished its running call, and after the stage's round before
        if self.config.serve_during_rounds:
            start = max(now, self.round_end[stage])
            held_until = start  # serving on through the round; held only while the round before runs
        else:
            start = max([now, self.round_end[stage], *(p.busy_until for p in mates if p.running is not None)])
            held_until = start + seconds
        end = start + seconds
        self.round_end[stage] = end
        n = len(mates)
        held = held_until - now
        self.rounds[stage].append((start, seconds, n, 2 * (n - 1) / n * self.gradient_bytes[stage] if n else 0.0, held))
        for p in mates:
            p.averaging_until = max(p.averaging_until, held_until)
        return end

    def report(self, since: float, until: float) -> dict:
        """The rounds that started in [since, until): their count, size, time and share of each stage's time."""
        steady = [[r for r in found if since <= r[0] < until] for found in self.rounds]
        every = [r for found in steady for r in found]
        span = max(until - since, 1e-9)
        shares = [sum(r[1] for r in found) / span for found in steady]
        held = [sum(r[4] for r in found) / span for found in steady]
        steps = [span / len(found) for found in steady if found]

        def mean(values: list[float]) -> float | None:
            return round(sum(values) / len(values), 4) if values else None

        return {
            "target_batch_size": self.config.target_batch_size,
            "gradient_mb": [round(b / 2**20, 1) for b in self.gradient_bytes],
            "rounds": sum(len(found) for found in self.rounds),
            "steady_rounds": len(every),
            "mean_mates": mean([float(r[2]) for r in every]),
            "mean_round_seconds": mean([r[1] for r in every]),
            "mean_step_seconds": mean(steps),
            "mean_mb_per_peer_per_round": mean([r[3] / 2**20 for r in every]),
            # the share of a step a stage's mates spend averaging, serving nothing: the mean over stages,
            # and the stage where it is largest
            "averaging_share": mean(shares),
            "averaging_share_max": round(max(shares), 4) if shares else None,
            # the share of time the mates served nothing for it (all of the round's unless serving through it)
            "held_share": mean(held),
            "serve_during_rounds": self.config.serve_during_rounds,
        }
