"""What makes the simulated DHT view unlike the truth: noisy speed measurements and records that lapse.

- Noise: every throughput a peer announces is off by a relative error drawn uniformly in
  +-`announce_noise`, afresh at each announcement (on top of the timing noise its moving average
  smooths), as a peer sharing its machine with other work measures itself.
- Lapses: a peer's record can be missing from the view for a while though the peer lives (a renewal
  no DHT node took): at each renewal, a peer not lapsed starts a lapse with probability
  `lapse_rate`. A whole stage's records can be missing at once (the node holding the stage's key
  out of reach): each stage starts such a lapse with probability `stage_lapse_rate` per renewal.
  A lapse lasts `lapse_seconds` times a factor drawn in [0.5, 1.5]. The trainers' routers read the
  same view, so they do not see a lapsed peer either.
"""

from __future__ import annotations

import random

from simulation.scenario import SimConfig


class ViewFaults:
    """Draws, from its own random stream, the noise of each announcement and which records lapse."""

    def __init__(self, config: SimConfig, num_stages: int, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self.peer_until: dict[str, float] = {}  # peer -> when its lapse ends
        self.stage_until = [0.0] * num_stages
        self.lapses = 0
        self.stage_lapses = 0

    def noisy(self, throughput: float) -> float:
        """An announced throughput, off by the measurement's noise."""
        noise = self.config.announce_noise
        return throughput * (1 + self.rng.uniform(-noise, noise)) if noise > 0 and throughput > 0 else throughput

    def renew(self, peers: list[str], now: float) -> None:
        """A renewal of every record: lapses end and start."""
        config = self.config
        if config.stage_lapse_rate > 0:
            for stage, until in enumerate(self.stage_until):
                if until <= now and self.rng.random() < config.stage_lapse_rate:
                    self.stage_until[stage] = now + self._duration()
                    self.stage_lapses += 1
        if config.lapse_rate > 0:
            for peer_id in peers:
                if self.peer_until.get(peer_id, 0.0) <= now and self.rng.random() < config.lapse_rate:
                    self.peer_until[peer_id] = now + self._duration()
                    self.lapses += 1

    def hidden(self, peer_id: str, stage: int, now: float) -> bool:
        """Whether a record of `peer_id` on `stage` is missing from the view now."""
        return self.stage_until[stage] > now or self.peer_until.get(peer_id, 0.0) > now

    def _duration(self) -> float:
        return self.config.lapse_seconds * self.rng.uniform(0.5, 1.5)
