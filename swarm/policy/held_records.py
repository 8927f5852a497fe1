"""The swarm as successive reads of the DHT show it: records held through lapses, and each peer's measured spread.

A DHT read can miss records of peers that live: a renewal no node accepted in time, a node holding a
stage's key out of reach for a while. A peer that looks gone, or a whole stage that looks empty, is
then taken for capacity lost, and the balance rule sends a peer to fill it; once the records are
back, the stage is over-filled and the rule sends one back. So the balance rule reads the swarm
through `HeldRecords`: a peer missing from a read still counts, as it was last seen, until `grace`
seconds after it was last seen. A stage counts as empty only when none of its peers has been seen
for that long, which, for a peer reading at each look, means empty in two looks in a row.

The speeds the rule compares are measured, and the measurements are noisy. Each renewal a read shows
adds the peer's announced throughput to its history on its stage (the last `history` of them); the
relative spread of those is its measured noise. A peer with few of its own readings gets the
swarm's pooled spread (the root mean square of every peer's), and never less: a peer measured
steady in three readings may just have been lucky. The rule (`swarm.policy.balance.plan_moves`)
asks a move to clear the noise of the capacities it compares, so noisier measurements mean fewer,
surer moves.

The reads also show every move: a peer seen on one stage and then leaving it, or serving another.
Each peer's move is remembered for `cooldown` seconds, and `barred` names, for every peer, the
stages it left within that time: the balance rule moves nobody back there
(`swarm.policy.rebalance_timing.ReturnCooldown` says why). Every peer reads the same moves, so every
peer bars the same returns and still computes the same plan; a bar only one peer knew of would have
the others count on a move it will not make, and nobody would move at all.

Pure: it reads no clock (`now` is given) and does no I/O, so the real peer
(`swarm.peer.rebalancing`) and the simulator (`scripts/simulation`) hold their views alike.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from swarm.records.stage_records import StageRecord

HISTORY = 8  # readings of one peer's throughput its spread is measured over
# a record missing from a read is held this many rebalance periods after it was last seen: a peer reads
# at its looks, 0.5 to 1.5 periods apart, so a stage counts as empty only if it was in two looks in a row
GRACE_PERIODS = 2.0
GRACE_TTLS = 3.0  # and never less than this many record lifetimes: a renewal can fail for a few in a row
OWN_SPREAD_READINGS = 3  # fewer readings of its own: a peer is judged by the swarm's pooled spread


def hold_grace(rebalance_period: float, announce_period: float, record_ttl: float) -> float:
    """Seconds a lapsed record is held: past the previous look, and never less than a record outlives its peer."""
    return max(GRACE_PERIODS * rebalance_period, GRACE_TTLS * record_ttl, record_ttl + 2 * announce_period)


@dataclass
class _Seen:
    """One peer as the latest read that showed it did, and its throughput readings on its stage."""

    at: float
    records: list[StageRecord]
    stage: int
    readings: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    renewed: float = math.nan  # the expiration of the reading taken last, to take each renewal once
    spread: float | None = None  # the relative spread of `readings`, kept as they change


class HeldRecords:
    """A peer's view of the swarm over its reads: `update` with each read, `spreads` for the balance rule."""

    def __init__(self, grace: float, history: int = HISTORY, cooldown: float = 0.0) -> None:
        if grace < 0 or history < 2 or cooldown < 0:
            raise ValueError("grace and cooldown must be 0 or more and history at least 2")
        self.grace = grace
        self.history = history
        self.cooldown = cooldown
        self.reads = 0
        self._seen: dict[str, _Seen] = {}
        self._left: dict[str, dict[int, float]] = {}  # peer -> stage it was seen to leave -> when

    def update(self, records: dict[int, list[StageRecord]], now: float) -> dict[int, list[StageRecord]]:
        """Takes one read of every stage; returns it with the records of the peers it missed, held as last seen."""
        self.reads += 1
        found: dict[str, list[StageRecord]] = {}
        for stage, listed in records.items():
            for record in listed:
                if record.stage == stage:
                    found.setdefault(record.peer_id, []).append(record)
        for peer_id, mine in found.items():
            self._saw(peer_id, mine, now)
        view = {stage: list(listed) for stage, listed in records.items()}
        for peer_id, seen in list(self._seen.items()):
            if peer_id in found:
                continue
            if now - seen.at > self.grace:
                del self._seen[peer_id]  # gone for longer than a lapse lasts: it is gone
                continue
            for record in seen.records:
                view.setdefault(record.stage, []).append(record)
        return view

    def _saw(self, peer_id: str, mine: list[StageRecord], now: float) -> None:
        # where it serves or joins; a mover's LEAVING record counts where it is going
        main = min(mine, key=lambda r: (r.state == "leaving", r.stage))
        stage = main.moving_to if main.state == "leaving" and main.moving_to >= 0 else main.stage
        seen = self._seen.get(peer_id)
        if seen is not None and seen.stage != stage and self.cooldown > 0:
            self._left.setdefault(peer_id, {})[seen.stage] = now
        if seen is None or seen.stage != stage:
            seen = self._seen[peer_id] = _Seen(now, mine, stage, deque(maxlen=self.history))
        seen.at, seen.records = now, mine
        if main.state == "serving" and main.expiration != seen.renewed and main.throughput > 0:
            seen.readings.append(float(main.throughput))
            seen.renewed = main.expiration
            seen.spread = _relative_spread(seen.readings)

    def barred(self, now: float) -> dict[str, frozenset[int]]:
        """For each peer seen to move within the cool-down, the stages it left then."""
        found = {}
        for peer_id, left in list(self._left.items()):
            recent = frozenset(stage for stage, at in left.items() if now - at < self.cooldown)
            if recent:
                found[peer_id] = recent
            else:
                del self._left[peer_id]
        return found

    def pooled_spread(self) -> float | None:
        """The swarm's relative spread: the root mean square over the peers read at least twice; None if none was."""
        squares = [seen.spread**2 for seen in self._seen.values() if seen.spread is not None]
        return math.sqrt(sum(squares) / len(squares)) if squares else None

    def spreads(self) -> dict[str, float] | None:
        """Each peer's relative spread of measured throughput; None until some peer has been read twice."""
        pooled = self.pooled_spread()
        if pooled is None:
            return None
        found = {}
        for peer_id, seen in self._seen.items():
            own = seen.spread if len(seen.readings) >= OWN_SPREAD_READINGS else None
            found[peer_id] = pooled if own is None else max(own, pooled)
        return found

    def ready(self) -> bool:
        """Whether the view rests on two reads at least, with a spread measured: only then may it move a peer."""
        return self.reads >= 2 and self.pooled_spread() is not None


def _relative_spread(readings: deque[float]) -> float | None:
    """Sample standard deviation over mean of a peer's readings; None under two readings."""
    n = len(readings)
    if n < 2:
        return None
    mean = sum(readings) / n
    if mean <= 0:
        return None
    variance = sum((x - mean) ** 2 for x in readings) / (n - 1)
    return math.sqrt(variance) / mean
