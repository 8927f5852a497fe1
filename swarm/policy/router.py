"""Stochastic wiring: which peer of a stage gets the next call. Pure: no network, no DHT.

Calls go out earliest finish time first: every peer is charged the expected service time of the
work sent to it, from the later of the end of its previous charge and now, and the next call goes
to the peer whose charge would end soonest. While the peers are kept busy, each gets work in
proportion to its speed, interleaved rather than in bursts (a weighted round robin). When they are
not, as at the end of a step, a slow peer gets a call only if it would finish it before a fast one
could: without the clock, a slow peer idle for a while held credit, took one of the step's last
microbatches and made the whole step wait for it. Expected times are moving averages of what the
calls to a peer took, kept apart for forward and backward; a peer never called yet is costed from
the throughput and queue it announces, and starts at the stage's current minimum so it is tried at once.
A call's charge begins no earlier than the peer's time on the network after now (each way, as its replies
showed it), so that at the end of a step a peer behind a slow link gets a call only if it would still answer
first, while calls queued at a peer are charged its service time alone (`swarm.policy.service_timing`).
Its first call of each kind costs nothing, so that it goes ahead of the others' next: a peer measures
its speed at start beside others loading too (five on one machine announce 20 to 370 samples/s), and
costed only by that claim, a peer that started slow would get no call, and so no timing, for steps.
An announced throughput is a claim: one far above its stage's (`swarm.policy.claim_bounds`: its peers'
claims, and the fastest speed this router timed there) costs the peer as a typical one of the stage, so
a record claiming 1e9 samples/s draws no more calls before its first reply than an honest newcomer would.

A peer that fails is banned for a time that doubles with every consecutive failure and resets on
success. One whose address refused the dial is gone, not slow: it gets no call until a record of it
newer than the one it was called by says it is back (a dead peer's record outlives it by its TTL, and
each time its ban lapsed, a stage whose last peer died looked served again and the calls went to it).
Each call's deadline follows the peer's observed latency, between a floor and a ceiling.

With `probation`, a peer earns work by answering: while a stage has a live peer that answered this
router, peers that never did get no calls of the training's own. They are tried with trial calls
instead (`trial_candidate`, a copy of a forward already answered elsewhere), at most a few at a time
per stage. A record is free to publish, so without it any number of identities that announce
themselves serving and never answer would each hold up a share of every step until its call timed out.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from swarm.policy.claim_bounds import claim_bound, lower_median
from swarm.records.stage_records import SERVING, StageRecord, reported_liars


@dataclass
class _Ban:
    until: float
    failures: int
    stage: int | None = None  # where the peer failed: a peer that moves (a restorer, say) is not banned where it goes


MAX_TRIALS = 2  # trial calls in flight per stage: identities that never answer hold up no more streams than that
# a backward recomputes the forward, then backpropagates: about three forwards' work
FORWARD_SHARE_OF_BACKWARD = 1 / 3
EWMA = 0.2
# calls whose expected ends are this close (a share of the call's cost) are tied: one goes to either at random
TIE_SHARE = 0.1


class Router:
    """Chooses peers for stage calls from the records it was last given."""

    def __init__(
        self,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        ban_base: float = 1.0,
        ban_max: float = 60.0,
        deadline_floor: float = 15.0,
        deadline_ceiling: float = 60.0,
        deadline_factor: float = 4.0,
        probation: bool = False,
    ) -> None:
        self.rng = rng or random.Random()
        self.clock = clock
        self.ban_base, self.ban_max = ban_base, ban_max
        self.deadline_floor, self.deadline_ceiling, self.deadline_factor = (
            deadline_floor,
            deadline_ceiling,
            deadline_factor,
        )
        self.records: dict[int, dict[str, StageRecord]] = {}
        self.bans: dict[str, _Ban] = {}
        self.bans_issued = 0
        # peers whose address refused the dial, with the expiration of their newest record then: no calls until a
        # newer record shows them renewing it
        self.gone: dict[str, float] = {}
        # observed seconds per sample, per (peer, backward), and when each peer is expected to finish what it was sent
        self.service: dict[tuple[str, bool], float] = {}
        self.network: dict[str, float] = {}  # per peer: seconds a call spends on the network, both ways
        self.finish: dict[int, dict[str, float]] = {}
        self.chosen: set[tuple[str, bool]] = set()  # (peer, backward) chosen once: its claim costs it from then on
        self.measured: dict[int, float] = {}  # per stage: the fastest backward speed timed there, samples/s
        self._live_before: dict[int, set[str]] = {}
        self.probation = probation
        self.answered: set[str] = set()  # peers that answered a call of this router: work goes to them first
        self.trials: dict[str, int] = {}  # peers under a trial call now, and their stage
        # peers that two others of their stage name as caught lying in their rounds: derived from the records
        # whenever they change, not on every call
        self.liars: set[str] = set()

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
        # a gone peer is back once a newer record of it is read, and forgotten once none is left
        self.gone = {p: at for p, at in self.gone.items() if self._newest_expiration(p) == at}
        self._note_liars()

    def _newest_expiration(self, peer_id: str) -> float | None:
        """The latest expiration among the records known of `peer_id` (None: none is known)."""
        return max((known[peer_id].expiration for known in self.records.values() if peer_id in known), default=None)

    def forget(self, peer_ids: Iterable[str]) -> None:
        """Drops the records of `peer_ids` (peers this trainer no longer calls), whatever their expiration."""
        for known in self.records.values():
            for peer_id in peer_ids:
                known.pop(peer_id, None)
        self._note_liars()

    def _note_liars(self) -> None:
        self.liars = set().union(*(reported_liars(list(known.values())) for known in self.records.values()))

    def live_peers(self, stage: int) -> list[StageRecord]:
        """Serving peers of `stage` that are neither banned now nor gone (see `report_failure`)."""
        now = self.clock()
        bans, gone, liars = self.bans, self.gone, self.liars
        return [
            r
            for r in self.records.get(stage, {}).values()
            if r.state == SERVING
            and r.peer_id not in liars
            and r.peer_id not in gone
            and not _banned(bans.get(r.peer_id), stage, now)
        ]

    def expected_seconds(self, record: StageRecord, backward: bool, samples: int) -> float:
        """How long `samples` samples of forward or backward work should take on this peer."""
        observed = self.service.get((record.peer_id, backward))
        if observed is None:
            per_sample = (1 + record.queue_length) / max(self.believed_throughput(record), 1e-3)
            observed = per_sample if backward else per_sample * FORWARD_SHARE_OF_BACKWARD
        return observed * samples

    def believed_throughput(self, record: StageRecord) -> float:
        """The throughput `record` announces, or its stage's typical one where that claim is out of bounds."""
        known = self.records.get(record.stage, {}).values()
        claims = [r.throughput for r in known if r.state == SERVING and r.peer_id != record.peer_id]
        claims.append(record.throughput)
        if record.throughput <= claim_bound(claims, self.measured.get(record.stage, 0.0)):
            return record.throughput
        return lower_median(c for c in claims if c > 0)

    def choose(
        self, stage: int, backward: bool = False, samples: int = 1, exclude: Iterable[str] = ()
    ) -> StageRecord | None:
        """The live peer of `stage` with the earliest expected finish time for this call; None if none is live.

        Peers in `exclude` (tried already for this call) are passed over while others remain, and so are peers
        that announce a largest microbatch below `samples` (a newcomer with a smaller limit than the step was
        split for) while others take it.
        """
        excluded = set(exclude)
        live = self.live_peers(stage)
        fitting = [r for r in live if not 0 < r.max_microbatch < samples] or live
        if self.probation:  # peers on probation take work only where no peer that answered is live
            fitting = [r for r in fitting if r.peer_id in self.answered] or fitting
        candidates = [r for r in fitting if r.peer_id not in excluded] or fitting
        if not candidates:
            return None
        finish = self.finish.setdefault(stage, {})
        previous = self._live_before.get(stage, set())
        self._live_before[stage] = {r.peer_id for r in live}
        staying = [finish[r.peer_id] for r in live if r.peer_id in finish and r.peer_id in previous]
        start = min(staying) if staying else 0.0
        for r in live:
            if r.peer_id not in previous or r.peer_id not in finish:
                # new, or back from a ban: its first call ends at the current minimum, so it is tried
                # at once, and it brings no credit (or debt) from before
                finish[r.peer_id] = start - self.expected_seconds(r, backward, samples)
        # a peer's charge starts no earlier than now: idle time is no credit toward later calls
        now = self.clock()
        network = self.network
        costs = {r.peer_id: self._cost(r, backward, samples) for r in candidates}
        ends = {p: max(finish[p], now + network.get(p, 0.0)) + cost for p, cost in costs.items()}
        best_peer = min(ends, key=ends.__getitem__)
        best = ends[best_peer]
        # ties: ends within a share of the best call's own cost (its finish times can be negative: a newcomer
        # starts below the minimum). Idle peers of one speed differ only by the noise in their timings, and
        # the one timed a little faster would otherwise take every call while the stage is not busy
        slack = TIE_SHARE * costs[best_peer]
        tied = [r for r in candidates if ends[r.peer_id] <= best + slack + 1e-12 * max(1.0, abs(best))]
        chosen = self.rng.choice(tied)
        finish[chosen.peer_id] = ends[chosen.peer_id]
        if self._untried(chosen.peer_id, backward):
            self.chosen.add((chosen.peer_id, backward))
            finish[chosen.peer_id] += self.expected_seconds(chosen, backward, samples)
        return chosen

    def _untried(self, peer_id: str, backward: bool) -> bool:
        return (peer_id, backward) not in self.chosen and (peer_id, backward) not in self.service

    def _cost(self, record: StageRecord, backward: bool, samples: int) -> float:
        """What a call adds to the peer's charge when choosing: nothing for its first of the kind, before any
        timing of it (see above)."""
        if self._untried(record.peer_id, backward):
            return 0.0
        return self.expected_seconds(record, backward, samples)

    def trial_candidate(self, stage: int) -> StageRecord | None:
        """A live peer of `stage` on probation to try now, marked as under trial until `trial_done`; None if the
        stage has no live peer that answered (its peers on probation get real calls), none on probation, or
        `MAX_TRIALS` trials under way."""
        if not self.probation:
            return None
        live = self.live_peers(stage)
        if not self.has_answered(stage):
            return None
        if sum(s == stage for s in self.trials.values()) >= MAX_TRIALS:
            return None
        waiting = [r for r in live if r.peer_id not in self.answered and r.peer_id not in self.trials]
        if not waiting:
            return None
        chosen = self.rng.choice(waiting)
        self.trials[chosen.peer_id] = stage
        return chosen

    def first_trials(self, stage: int, limit: int) -> list[StageRecord]:
        """Up to `limit` live peers of `stage` on probation, at random, marked as under trial: the trainer's first
        contact, before any work (so that its first step does not wait on identities that answer nothing)."""
        if not self.probation:
            return []
        waiting = [r for r in self.live_peers(stage) if r.peer_id not in self.answered and r.peer_id not in self.trials]
        chosen = self.rng.sample(waiting, min(limit, len(waiting)))
        self.trials.update((r.peer_id, stage) for r in chosen)
        return chosen

    def has_answered(self, stage: int) -> bool:
        """Whether a live peer of `stage` answered this router."""
        return any(r.peer_id in self.answered for r in self.live_peers(stage))

    def trial_done(self, peer_id: str) -> None:
        """The trial call to `peer_id` ended (its outcome is reported as any call's)."""
        self.trials.pop(peer_id, None)

    def deadline(self, record: StageRecord, backward: bool, samples: int) -> float:
        """Seconds to wait for a call before giving up on the peer: a multiple of its expected time, bounded.

        The expected time counts what this router sent the peer before (a call chosen just now is expected
        to end at the peer's finish time): a call queued behind others is not given up for waiting on them.
        """
        expected = self.expected_seconds(record, backward, samples) + self.network.get(record.peer_id, 0.0)
        finish = self.finish.get(record.stage, {}).get(record.peer_id)
        if finish is not None:
            expected = max(expected, finish - self.clock())
        return min(self.deadline_ceiling, max(self.deadline_floor, self.deadline_factor * expected))

    def report_success(
        self, peer_id: str, backward: bool = False, samples: int = 0, seconds: float = 0.0, network: float = 0.0
    ) -> None:
        """Lifts any ban, ends any probation and folds the call's service `seconds` (`ServiceTimer`) into the
        peer's expected service time, and its `network` seconds into the peer's time on the network."""
        self.bans.pop(peer_id, None)
        self.gone.pop(peer_id, None)
        self.answered.add(peer_id)
        if network > 0:
            self.network[peer_id] = _moving_average(self.network.get(peer_id), network)
        if samples > 0:
            key = (peer_id, backward)
            self.service[key] = _moving_average(self.service.get(key), seconds / samples)
            if backward and self.service[key] > 0:
                for stage, known in self.records.items():
                    if peer_id in known:
                        self.measured[stage] = max(self.measured.get(stage, 0.0), 1 / self.service[key])

    def report_failure(self, peer_id: str, refused: bool = False, stage: int | None = None) -> float:
        """Bans `peer_id` (on `stage`, where given) with exponential backoff; returns the seconds the ban has left.
        `refused`: its address refused the dial, so it is gone until a newer record of it than those known now is
        read. A failure while the peer is banned there is a call that was in flight when the ban began: the same
        trouble, not a new one (four calls into a peer that was leaving its stage banned it for 8 s at once, and it
        served a restored stage meanwhile)."""
        if refused:
            self.mark_gone(peer_id)
        now = self.clock()
        ban = self.bans.get(peer_id)
        earlier = ban if ban is not None and ban.stage == stage else None  # the count goes on where it was earned
        if earlier is not None and earlier.until > now:
            return earlier.until - now
        failures = earlier.failures + 1 if earlier is not None else 1
        length = min(self.ban_base * 2 ** (failures - 1), self.ban_max)
        self.bans[peer_id] = _Ban(now + length, failures, stage)
        self.bans_issued += 1
        return length

    def mark_gone(self, peer_id: str) -> None:
        """Nothing listens where `peer_id` served: it gets no call until a record of it newer than those known now."""
        if (newest := self._newest_expiration(peer_id)) is not None:
            self.gone[peer_id] = newest


def _banned(ban: _Ban | None, stage: int, now: float) -> bool:
    """Whether `ban` keeps its peer from calls to `stage` at `now`."""
    return ban is not None and ban.until > now and ban.stage in (None, stage)


def _moving_average(previous: float | None, value: float) -> float:
    """`value` folded into the moving average `previous` (None: the first value)."""
    return value if previous is None else (1 - EWMA) * previous + EWMA * value
