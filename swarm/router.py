"""Stochastic wiring: which peer of a stage gets the next call. Pure: no network, no DHT.

Each call picks a serving peer of the stage at random, weighted by the throughput the peer
announces, discounted by its announced queue. A peer that fails is banned for a time that doubles
with every consecutive failure and resets on success.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from swarm.stage_records import SERVING, StageRecord


@dataclass
class _Ban:
    until: float
    failures: int


class Router:
    """Chooses peers for stage calls from the records it was last given."""

    def __init__(
        self,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        ban_base: float = 1.0,
        ban_max: float = 60.0,
    ) -> None:
        self.rng = rng or random.Random()
        self.clock = clock
        self.ban_base, self.ban_max = ban_base, ban_max
        self.records: dict[int, dict[str, StageRecord]] = {}
        self.bans: dict[str, _Ban] = {}

    def update(self, records: dict[int, list[StageRecord]], now: float) -> None:
        """Merges fresh records into the known ones and forgets those expired at DHT time `now`.

        A record is replaced only by a newer one (later expiration), so a DHT read that misses a
        peer does not make it vanish before its record has actually expired.
        """
        for stage, fresh in records.items():
            known = self.records.setdefault(stage, {})
            for record in fresh:
                if record.peer_id not in known or record.expiration >= known[record.peer_id].expiration:
                    known[record.peer_id] = record
        for known in self.records.values():
            for peer_id in [p for p, r in known.items() if r.expiration <= now]:
                del known[peer_id]

    def live_peers(self, stage: int) -> list[StageRecord]:
        """Serving peers of `stage` that are not banned now."""
        now = self.clock()
        return [
            r
            for r in self.records.get(stage, {}).values()
            if r.state == SERVING and self.bans.get(r.peer_id, _Ban(0.0, 0)).until <= now
        ]

    def choose(self, stage: int, exclude: Iterable[str] = ()) -> StageRecord | None:
        """A random live peer of `stage`, weighted by speed; None if the stage has none."""
        excluded = set(exclude)
        candidates = [r for r in self.live_peers(stage) if r.peer_id not in excluded] or self.live_peers(stage)
        if not candidates:
            return None
        weights = [max(r.throughput, 1e-3) / (1 + r.queue_length) for r in candidates]
        return self.rng.choices(candidates, weights=weights)[0]

    def report_success(self, peer_id: str) -> None:
        self.bans.pop(peer_id, None)

    def report_failure(self, peer_id: str) -> float:
        """Bans `peer_id` with exponential backoff; returns the ban's length in seconds."""
        failures = self.bans[peer_id].failures + 1 if peer_id in self.bans else 1
        length = min(self.ban_base * 2 ** (failures - 1), self.ban_max)
        self.bans[peer_id] = _Ban(self.clock() + length, failures)
        return length
