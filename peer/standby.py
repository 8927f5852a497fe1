"""Standby copies of other stages' state, and the restore of a stage whose every peer died.

With `--standby-stages K`, a peer of stage s also holds a copy of the state (parameters, optimizer state, step) of
stages s+1 .. s+K (mod the number of stages), in host memory (or, past `--standby-memory-mb`, in
`--checkpoint-dir`), never on the accelerator. Its record lists each copy as (stage, step, parameter fingerprint).
The holder catches the copy up with the stage's step deltas (`swarm.peer.step_deltas`: every announce period while
the swarm shows churn, else once the copy is a quarter of the kept steps behind), or, where those cannot reach it,
downloads the whole state once the stage is `--standby-every` steps past it and the whole refreshes have taken no
more than `--standby-share` of the time. Both go over the stage-mates' state protocol: a stage's peers give their
state to a peer whose signed record names it as a standby holder of that stage, without taking it for a mate. As a
joiner does, the holder takes only a (step, fingerprint) that two of the stage's peers confirm, where two or more
serve.

A stage is lost when no record shows a peer serving or joining it for `LOST_GRACE` announce periods. If its last
peers died (their records vanished, none saying it was leaving), every holder then computes, from the same records,
which of them restores it (`choose_restorer`: a copy close to the freshest; a holder whose own stage keeps another
serving peer; a movable one first; ties by peer id). That peer leaves its stage as on a move and builds the lost
stage from its copy, at the copy's step, and says how many steps of progress were lost. A stage whose last peers
left on request (a stop, a preemption notice) is not taken over: whoever stops a swarm one peer at a time does not
want its stages shuffled. Where no holder restores a lost stage within `FILL_PERIODS` more announce periods (at once
where none may), a peer of the stage with the most to spare moves there (`swarm.policy.empty_stages`) once the
stage's peers refused a dial or their records lapsed, and a period later where the records' choice failed its probe.
A peer that joins an empty stage (a newcomer with `--stage auto` picks one first) takes the freshest copy from a
holder over `STANDBY_PROTOCOL`, which answers only a peer whose signed record is on that stage."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from swarm.models.optimizer import OptimizerSettings
from swarm.peer.copy_sources import INFO_TIMEOUT, CopySources
from swarm.peer.death_watch import DeathWatch
from swarm.peer.delta_transfer import request_deltas, takes_whole
from swarm.peer.held_reads import HeldReads
from swarm.peer.liveness_probes import LivenessProbes
from swarm.peer.stage_state import StageStateError, check_state_tensors, parameter_fingerprint
from swarm.peer.standby_copy import Standby
from swarm.peer.standby_host import StandbyHost
from swarm.peer.standby_newcomer import JOIN_RESTORE_TIMEOUT, STATE_TIMEOUT, NewcomerRestore, answer_standby
from swarm.peer.state_file import write_tensor_list
from swarm.peer.state_transfer import (
    announced_versions,
    confirmed_versions,
    parameters_fingerprint,
    request_state,
    state_handler,
)
from swarm.policy.copy_holders import capped_targets
from swarm.policy.empty_stages import choose_filler
from swarm.policy.lost_stages import choose_restorer, lost_stages, standby_holders, standby_targets
from swarm.records.sample_ledger import restore_record
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord

logger = logging.getLogger(__name__)

LOST_GRACE = 2  # announce periods a stage shows no serving or joining record before it counts as lost
FILL_PERIODS = 3  # announce periods after that in which a holder may restore it before another peer fills it
CHURN_MEMORY = 600.0  # seconds after a peer's death during which copies follow their stages step by step
HEARD_MEMORY = 60.0  # seconds after a read last showed a record whose peer saw a death (`saw_death`)
FOLLOWING_SHARE = 0.5  # least share of time whole refreshes may take while following (at 5%, a copy was 73 steps old)
MAX_DELTA_MISSES = 2  # sources whose deltas led nowhere confirmed before a stage's copy is only refreshed whole
WHOLE_SWARM_EVERY = 5  # announce periods between a keeper's reads of every stage; in between, the ones it holds
# announce periods a peer whose record vanished from a read is asked whether it lives before it is forgotten (a read
# can miss a live peer's record: a DHT node that missed its last store); only a failed probe says it died
SUSPECT_PERIODS = 10


class StandbyKeeper:
    """A peer's standby copies: refreshes them, watches for lost stages, restores one when it is chosen."""

    def __init__(self, peer: StandbyHost) -> None:
        self.peer = peer
        config = peer.config
        self.count = config.standby_stages
        self.churn_count = config.standby_stages_under_churn
        self.every = config.standby_every
        self.share = config.standby_share
        # per stage: when (time.monotonic) its last whole refresh ended and how long it took, see --standby-share
        self.last_refresh: dict[int, tuple[float, float]] = {}
        self.budget = int(config.standby_memory_mb * 2**20)
        self.spill_dir = Path(config.checkpoint_dir) / "standby" if config.checkpoint_dir else None
        self.standbys: dict[int, Standby] = {}
        self.fetching: set[int] = set()
        self.sources = CopySources(peer)  # versions of the stages held, whom to take a copy from, their shapes
        self.empty_since: dict[int, float] = {}
        self.hinted: set[int] = set()  # stages other peers' records name empty, beyond those this peer reads anyway
        self.seen_serving: set[int] = set()  # stages a record showed served: only those can be lost
        self.left_on_request: set[int] = set()  # lost stages whose last peers left on request: not restored
        self.last_step: dict[int, int] = {}  # the highest step seen announced per stage
        self.reads = 0  # announce periods so far, each with a read (see stages_to_read)
        self.held_reads = HeldReads()  # the held stages' last records, standing in between their reads
        self.restore_pending: int | None = None
        self.restored: list[tuple[int, int, int]] = []  # (stage, step, steps lost) of each restore by this peer
        self.claimed: tuple[int, int, str, float] | None = None  # (stage, step, fingerprint, when) of a restore untold
        self.bytes_received = 0
        self.refreshes = 0
        self.deltas = config.standby_deltas  # how many steps' deltas the stage's peers keep (0: refresh whole)
        self.copies_cap = config.standby_copies  # the most copies of a stage the swarm keeps (0: no cap)
        self.capped: dict[tuple[int, int], set[int]] = {}  # (own stage, next stages held) -> the cap's choice
        self.calm_deltas = config.standby_calm_deltas  # whether copies follow by deltas with no churn too
        self.deltas_applied = 0
        self.no_deltas: dict[int, int] = {}  # per stage: the copy's step its peers had no deltas from
        self.present: dict[int, dict[str, str]] = {}  # per stage read: its peers and their states, at the last read
        self.last_death = float("-inf")  # when a peer was last counted dead (see _confirm_deaths)
        self.heard_of_death = float("-inf")  # when a read last showed a record saying its peer saw a death
        self.vanished: dict[str, tuple[int, float]] = {}  # peer id -> (stage, DHT time) its record vanished, unprobed
        self.deaths = 0  # peers counted dead: records gone, not saying they left, and a probe since failed
        # peers of the stages held and of the peer's own, asked whether they live (see liveness_probes and _probe)
        self.probes = LivenessProbes(config.record_ttl, timeout=max(1.0, config.announce_period))
        self.watch = DeathWatch(self.probes, lambda coroutine: self._spawn(coroutine))  # deaths seen at once
        self.to_probe: set[str] = set()  # beyond those: holders chosen to restore a lost stage, asked once
        self._tasks: set[asyncio.Task] = set()
        self._warned_budget: set[int] = set()
        # `STANDBY_PROTOCOL`: gives a held copy to a peer whose signed record is on that copy's stage
        self.handle_standby = state_handler(
            functools.partial(answer_standby, peer, self.standbys),
            failure="Failed to give a standby copy",
            caller="a standby request",
        )

    # --- what the record says -----------------------------------------------------------------------

    def targets(self) -> list[int]:
        """The stages this peer holds copies of: the next `--standby-stages`, and while the swarm shows churn the
        next `--standby-stages-under-churn`, so that a wave that takes a stage and the peers of the stage before
        it leaves a copy on another stage; of those, the ones where it is among a stage's first `--standby-copies`
        holders (`swarm.policy.copy_holders`)."""
        count = max(self.count, self.churn_count) if self.following(time.monotonic()) else self.count
        targets = standby_targets(self.peer.stage, self.peer.config.num_stages, count)
        if self.copies_cap <= 0:
            return targets
        capped = self.capped.get((self.peer.stage, count))
        if capped is None:  # before the first read of every stage (since a move): only the copies held or fetched
            allowed = self.standbys.keys() | self.fetching
        else:  # a copy of a stage that looks lost is kept whatever the cap: the stage may come back from it
            allowed = capped | (self.empty_since.keys() & self.standbys.keys()) | self.fetching
        return [t for t in targets if t in allowed]

    def announced(self) -> tuple[tuple[int, int, str], ...]:
        """The record's `standbys`: each target stage with the copy held (step -1 before the first)."""
        copies = {stage: self.standbys.get(stage) for stage in self.targets()}
        return tuple((stage, *c.version) if c else (stage, -1, "") for stage, c in copies.items())

    def announced_empty(self) -> tuple[int, ...]:
        """The record's `empty`: the stages this peer sees with no live peer (not those left on request)."""
        return tuple(sorted(s for s in self.empty_since if s not in self.left_on_request))

    def held_bytes(self) -> int:
        return sum(copy.nbytes for copy in self.standbys.values() if copy.in_memory)

    # --- every announce period ----------------------------------------------------------------------

    def stages_to_read(self) -> list[int] | None:
        """The stages this period's read needs (the peer's own and those it holds copies of, while copies follow
        their stages only every few periods: see `held_reads`), or None for every stage: every `WHOLE_SWARM_EVERY`
        periods (which peers hold copies of this peer's stage) and while a stage looks lost, here or in another
        peer's record (its restorer, or the peer that fills it, is chosen from every peer's record)."""
        self.reads += 1
        woken = self.probes.take_news()  # a peer fell silent: its stage may be lost, and a restorer is chosen at once
        if self.reads % WHOLE_SWARM_EVERY == 1 or self.empty_since or self.hinted or woken:
            return None
        return [self.peer.stage, *self.held_reads.wanted(self.reads, self.targets(), self.following(time.monotonic()))]

    def observe(self, records: dict[int, list[StageRecord]], whole_swarm: bool = True) -> None:
        """Updates who may take this peer's stage's state, refreshes copies, and restores a lost stage.

        `records` holds the stages read this period; unless `whole_swarm`, some are left out, and nothing
        is concluded about those. Records of peers that failed a probe since their last renewal are left out.
        """
        peer = self.peer
        records = self.held_reads.merge(self.reads, records, self.targets())
        for stage, group in records.items():  # a dead peer's last words too: how far its stage got
            if group:
                self.last_step[stage] = max([self.last_step.get(stage, 0), *(r.step for r in group)])
        read, records = records, self.probes.live(records)
        # stages another peer's probes found empty: probed here too, so that a peer of any stage can fill one
        # before its records lapse (a first wave's lost stage waited for that, 13-16 s, when its holders died)
        regular = {peer.stage, *self.targets()}
        self.hinted = {s for g in read.values() for r in g if r.peer_id != peer.peer_id for s in r.empty} - regular
        self._probe(records)
        if peer.mates is not None and whole_swarm:
            peer.mates.standby_holders = standby_holders(peer.stage, records)
        if whole_swarm:
            self._cap_copies(records)
        targets = self.targets()
        for stage in [s for s in self.standbys if s not in targets]:
            self._drop(stage)
        now = time.monotonic()
        self._confirm_deaths(read, now)
        self._note_stages(records, now, read)
        self._refresh_copies(records, now)
        if peer.state != SERVING or self.restore_pending is not None or not whole_swarm:
            return
        grace = LOST_GRACE * peer.config.announce_period
        for stage in sorted(self.standbys):
            since = self.empty_since.get(stage)
            if since is None or stage in self.left_on_request:
                continue
            chosen = choose_restorer(stage, records)
            if chosen is not None and chosen[0] != peer.peer_id:
                self.to_probe.add(chosen[0])  # a holder killed in the same wave restores nothing: find out
            # not where another holder already left its stage for it (views a read apart can choose two), unless
            # that one failed a probe since: a restorer killed on its way restores nothing
            coming = self.probes.on_the_way(stage, records)
            self.to_probe |= coming
            mine = chosen is not None and chosen[0] == peer.peer_id and not coming
            if mine and now - since >= grace:
                copy = self.standbys[stage]
                logger.warning(
                    f"Stage {stage} has had no peer for {now - since:.0f}s; restoring it from this peer's standby "
                    f"copy of step {copy.step}"
                )
                self.restore_pending = stage
                peer.request_move(stage)
                return
        self._fill_empty(records, now, read)

    def _probe(self, records: dict[int, list[StageRecord]]) -> None:
        """Starts this period's probes of the peers records put on this peer's stage, the stages it holds copies of
        and those another record names empty (see below), and of last period's restorers; their answers count from
        the next period's records on, and stand in for a catch-up's version asks (`CopySources.announced`)."""
        peer = self.peer
        if getattr(peer.mates, "p2p", None) is None:
            return
        held = self.targets()
        stages = {peer.stage, *held, *self.hinted}
        named = {r.peer_id for s in stages for r in records.get(s, []) if r.state in (SERVING, JOINING)}
        stalled = self.probes.stalled((r for s in stages for r in records.get(s, [])), peer.config.announce_period)
        if not (self.empty_since or self.hinted):
            # a peer that renews its record lives (probing each every period cost the bench 5%), one that stopped is
            # asked (a first wave pays a period); while following, every held stage's peer (read every few periods)
            following = self.following(time.monotonic())
            named &= stalled | ({r.peer_id for s in held for r in records.get(s, [])} if following else set())
        named |= self.to_probe
        named.discard(peer.peer_id)
        if named and not self.probes.in_flight:
            self.to_probe = set()  # asked now; while a round is in flight they wait for the next one
            self._spawn(self.probes.probe(peer.mates.p2p, named))
        self.watch.follow(peer.mates.p2p, records, held, peer.peer_id)

    def _note_stages(
        self, records: dict[int, list[StageRecord]], now: float, read: dict[int, list[StageRecord]]
    ) -> None:
        """Notes from the stages read this period how far each got, which look lost, and which peers died.

        `records` is `read` less the peers that failed a probe: a stage lost only by that is lost since the probe."""
        lost = lost_stages(records, self.peer.config.num_stages) & set(records)
        probed = lost - lost_stages(read, self.peer.config.num_stages)
        peer_period = self.peer.config.announce_period
        for stage, group in records.items():
            if any(r.state == SERVING for r in group):
                self.seen_serving.add(stage)
            # from every record read, a probe's verdict aside: a slow answer on a loaded machine is no death
            present = {r.peer_id: r.state for r in read[stage]}
            for peer_id, state in self.present.get(stage, {}).items():
                if peer_id not in present and state != LEAVING:  # its record gone, not saying it was leaving
                    self._note_gone(peer_id, stage, now)
            if any(r.saw_death and r.peer_id != self.peer.peer_id for r in group):
                self.heard_of_death = now  # a peer that joined after the deaths learns of them from the others
            self.present[stage] = present
            if stage in lost and stage not in self.empty_since:
                # lost by probes: a period ago; by refused dials, the grace ago (see LivenessProbes.refused)
                periods = LOST_GRACE if self.probes.all_refused(read[stage]) else 1
                self.empty_since[stage] = now - (periods * peer_period if stage in probed else 0.0)
                # its last peers said they were leaving on request (a stop, a preemption notice), not moving: not dead
                if any(r.state == LEAVING and r.moving_to < 0 for r in group):
                    self.left_on_request.add(stage)
            elif stage not in lost:
                self.empty_since.pop(stage, None)
                self.left_on_request.discard(stage)

    def _note_gone(self, peer_id: str, stage: int, now: float) -> None:
        """A peer's record vanished from a stage's records without saying it was leaving: its peer died, or a read
        missed a live record (a DHT node that missed its last store). It is asked first; unaskable, it counts."""
        if getattr(self.peer.mates, "p2p", None) is None:
            self._count_death(peer_id, stage, now, "left no record")
        else:
            self.vanished.setdefault(peer_id, (stage, get_dht_time()))
            self.to_probe.add(peer_id)

    def _confirm_deaths(self, read: dict[int, list[StageRecord]], now: float) -> None:
        """Settles the peers whose records vanished: dead once a probe sent since failed, alive once one answered or
        their records are read again; asked again each period until then, forgotten after `SUSPECT_PERIODS`."""
        seen = {r.peer_id for group in read.values() for r in group}
        forget_before = get_dht_time() - SUSPECT_PERIODS * self.peer.config.announce_period
        for peer_id, (stage, since) in list(self.vanished.items()):
            verdict = self.probes.verdict(peer_id, since)
            expired = since < forget_before
            if peer_id not in seen and verdict is False:
                self._count_death(peer_id, stage, now, "left no record and failed a probe")
            if verdict is not None or peer_id in seen or expired:
                del self.vanished[peer_id]
            else:
                self.to_probe.add(peer_id)

    def _count_death(self, peer_id: str, stage: int, now: float, why: str) -> None:
        """A peer of `stage` died: the swarm shows churn, and copies follow their stages step by step."""
        if not self.saw_death(now):
            logger.info(
                f"Peer {peer_id[-8:]} of stage {stage} {why}: counting it dead; standby copies follow their "
                f"stages step by step for {CHURN_MEMORY:.0f}s"
            )
        self.last_death = now
        self.deaths += 1

    def _cap_copies(self, records: dict[int, list[StageRecord]]) -> None:
        """Which targets the cap (`--standby-copies`) leaves this peer, from a read of every stage."""
        peer, cap, held, n_stages = self.peer, self.copies_cap, set(self.standbys), self.peer.config.num_stages
        counts = {self.count, max(self.count, self.churn_count)} if cap > 0 else set()
        self.capped = {
            (peer.stage, n): set(capped_targets(peer.peer_id, peer.stage, n_stages, n, cap, records, held))
            for n in counts
        }

    def following(self, now: float) -> bool:
        """Whether copies follow their stages step by step: while this peer saw a peer die within `CHURN_MEMORY`
        seconds, or another peer's record says it did (a newcomer to a churning swarm saw no death itself, and
        its copies would fall 15 steps behind; any record may say so: the cost is that of churn, deltas)."""
        return self.saw_death(now) or now - self.heard_of_death < HEARD_MEMORY

    def saw_death(self, now: float | None = None) -> bool:
        """Whether this peer itself saw a peer die within `CHURN_MEMORY` seconds (its record says so)."""
        return (time.monotonic() if now is None else now) - self.last_death < CHURN_MEMORY

    def _refresh_copies(self, records: dict[int, list[StageRecord]], now: float) -> None:
        """Starts the refresh each held copy is due: its stage's step deltas, every announce period while the swarm
        shows churn and once a quarter of the kept steps behind in the calm (`--standby-calm-deltas`); the whole
        state every `--standby-every` steps, within `--standby-share`, where no deltas reach the copy."""
        if self.peer.state != SERVING:
            return
        own = next((r for r in records.get(self.peer.stage, []) if r.peer_id == self.peer.peer_id), None)
        for stage in self.targets():
            serving = [r for r in records.get(stage, []) if r.state == SERVING and r.peer_id not in self.accused()]
            copy = self.standbys.get(stage)
            if copy is None and (own is None or own.standby_of(stage) is None):
                # a copy goes to holders the records name: asked before, each giver refused it and read every stage
                continue
            newest = max((r.step for r in serving), default=-1)
            if copy is not None and self.held_reads.stood_in(stage, self.reads):
                newest = max(newest, copy.step + 1)  # records that stood in trail their stage: the catch-up asks
            if not serving or stage in self.fetching:
                continue
            if self._deltas_reach(copy, newest):
                # in the calm too, a quarter of the kept steps behind the newest step two records confirm: a wave
                # comes without warning (copies refreshed whole every 15 steps lost 8-9 steps to a first one)
                reach = max((version[0] for version in announced_versions(serving).values()), default=newest)
                lagging = reach - copy.step >= max(1, self.deltas // 4)
                if self.following(now) or (lagging and self.calm_deltas):
                    self._spawn(self.catch_up(stage, serving), fetching=stage)
                continue
            # a copy at step 0 would be worth nothing: a stage restarted from scratch has the same parameters
            step = copy.step if copy is not None else 0
            # a copy its stage's peers had no deltas for is taken whole at once, not every-so-many steps
            due = newest >= step + self.every or (self.no_deltas.get(stage) == step and newest > step)
            if due and now >= self._refresh_due(stage, now):
                self._spawn(self.refresh(stage, [r.peer_id for r in serving]), fetching=stage)

    def _refresh_due(self, stage: int, now: float) -> float:
        """When `stage`'s copy may be refreshed whole again (after its last refresh, whole or by deltas): its copies'
        cost stays a bounded share of the time, whatever the step rate and state size; a larger one under churn."""
        ended, took = self.last_refresh.get(stage, (0.0, 0.0))
        share = max(self.share, FOLLOWING_SHARE) if self.following(now) else self.share
        return ended + took / share

    def _fill_empty(
        self, records: dict[int, list[StageRecord]], now: float, read: dict[int, list[StageRecord]]
    ) -> None:
        """Moves this peer to a lost stage no holder restores, if `records` (`read` less failed probes) choose it."""
        peer = self.peer
        for stage, since in sorted(self.empty_since.items()):
            # the holders have their periods first, unless none can (each its own stage's last peer: waiting anyway
            # served a first wave's lost stage 15 s late). Where only this peer's probes say none can (a holder's
            # mate slow to answer), one period more for a holder that found itself chosen: both once moved
            if choose_restorer(stage, records) is not None:
                extra = FILL_PERIODS
            else:
                extra = 1 if choose_restorer(stage, read) is not None else 0
            grace = (LOST_GRACE + extra) * peer.config.announce_period
            # a stage never seen served is one whose peers are still starting; a filler moves once the stage's peers
            # refused a dial or their records lapsed, never on a probe that timed out (a stage's one slow peer on a
            # loaded start once drew the peer of a two-peer stage that way, and that stage was left one bad peer)
            if now - since < grace or stage in self.left_on_request or stage not in self.seen_serving:
                continue
            if stage not in lost_stages(read, peer.config.num_stages) and not self.probes.all_refused(read[stage]):
                continue
            barred = self.accused()
            if choose_filler(stage, records, barred) != peer.peer_id or self.probes.on_the_way(stage, records):
                continue
            # chosen only because the one the records choose failed this peer's probe: one period more for that one
            # to show its move (a stage-0 peer stalled on a loaded host once drew two stage-1 fillers)
            if choose_filler(stage, read, barred) != peer.peer_id and now - since < grace + peer.config.announce_period:
                continue
            copy = self.standbys.get(stage)
            logger.warning(
                f"Stage {stage} has had no peer for {now - since:.0f}s and no holder of its copy is restoring it; "
                f"moving there from stage {peer.stage} (the stage with the most to spare) "
                + (f"with this peer's copy of step {copy.step}" if copy else "to take a copy, if one can still be had")
            )
            if copy is not None:
                self.restore_pending = stage
            peer.request_move(stage)
            return

    def accused(self) -> set[str]:
        """Peers a vouched trainer's spot check accused: never a source of a copy (`swarm.records.accusations`)."""
        return set(self.peer.mates.membership.accused) if self.peer.mates is not None else set()

    def _spawn(self, coroutine, fetching: int | None = None) -> None:
        if fetching is not None:  # under way now: two reads ending together once started two catch-ups of one copy
            self.fetching.add(fetching)
        self._tasks.add(task := asyncio.ensure_future(coroutine))
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _drop(self, stage: int) -> None:
        if (copy := self.standbys.pop(stage, None)) is not None and copy.path is not None:
            copy.path.unlink(missing_ok=True)

    # --- refreshing a copy ----------------------------------------------------------------------------

    async def refresh(self, stage: int, serving: list[str]) -> None:
        """Downloads `stage`'s state from one of its serving peers, taking only a confirmed version (marked fetching by
        `_spawn`)."""
        started = time.perf_counter()
        try:
            versions = await self.sources.answered(stage, serving)
            if (picked := self.sources.pick(stage, versions)) is None:
                return
            source = picked[0]
            model = self.peer.config.model
            given = await request_state(
                self.peer.mates.p2p, source, model, stage, self.sources.limits(stage), STATE_TIMEOUT
            )
            step, tensors, has_optimizer_state = given.step, given.tensors, given.has_optimizer_state
            samples_stepped = given.samples_stepped
            template = self.sources.template(stage)
            check_state_tensors(template, tensors, has_optimizer_state)
            fingerprint = await parameters_fingerprint(template, tensors)
            if (step, fingerprint) not in confirmed_versions(versions):
                # the source stepped since its mates were asked: ask them again
                if (step, fingerprint) not in confirmed_versions(await self.sources.answered(stage, serving)):
                    raise StageStateError(f"no other peer confirms step {step}, fingerprint {fingerprint}")
            if stage not in self.targets():
                return  # this peer moved meanwhile
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.bytes_received += nbytes
            self.refreshes += 1
            copy = Standby(stage, step, samples_stepped, has_optimizer_state, fingerprint, nbytes)
            old = self.standbys.get(stage)
            in_memory = self.held_bytes() - (old.nbytes if old and old.in_memory else 0)
            if in_memory + nbytes <= self.budget:
                copy.tensors = tensors
            elif self.spill_dir is not None:
                name = f"standby-{model}-stage{stage}-of-{self.peer.config.num_stages}.safetensors"
                copy.path = self.spill_dir / name
                await asyncio.get_running_loop().run_in_executor(None, write_tensor_list, copy.path, tensors)
            else:
                if stage not in self._warned_budget:
                    self._warned_budget.add(stage)
                    logger.warning(
                        f"Not holding a standby copy of stage {stage}: {nbytes / 2**20:.1f} MiB would exceed "
                        "--standby-memory-mb, and there is no --checkpoint-dir to keep it on disk"
                    )
                return
            if old is not None and old.path is not None and old.path != copy.path:
                old.path.unlink(missing_ok=True)
            self.standbys[stage] = copy
            logger.info(
                f"Refreshed the standby copy of stage {stage} at step {step} (fingerprint {fingerprint}) "
                f"from {source}: {nbytes} bytes in {time.perf_counter() - started:.2f}s "
                f"({self.bytes_received} bytes over {self.refreshes} refreshes)"
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.info(f"Could not refresh the standby copy of stage {stage}: {type(e).__name__}: {e}")
        finally:
            self.fetching.discard(stage)
            self.last_refresh[stage] = (time.monotonic(), time.perf_counter() - started)

    def _deltas_reach(self, copy: Standby | None, newest: int) -> bool:
        """Whether `copy` can be caught up with its stage's step deltas, now at step `newest`."""
        if copy is None or not copy.in_memory or not copy.step < newest <= copy.step + self.deltas:
            return False
        return self.no_deltas.get(copy.stage) != copy.step and self.sources.misses(copy.stage) < MAX_DELTA_MISSES

    async def catch_up(self, stage: int, serving: list[StageRecord]) -> None:
        """Catches `stage`'s live copy up with the newest version two of its `serving` peers confirm (their records,
        and while peers die their answers too: see `CopySources.announced`), step delta by delta.

        The copy's parameters must then show that version's fingerprint. If they do not (a source that lies,
        or peers whose arithmetic differs from this host's), the copy is dropped and taken whole at once; after
        such misses from `MAX_DELTA_MISSES` sources, the stage's copy is only refreshed whole (a source that missed
        is not asked again: one liar cannot turn the following off)."""
        if (copy := self.standbys.get(stage)) is None:  # dropped between `_spawn` (which marked it fetching) and now
            self.fetching.discard(stage)
            return
        started: float | None = None  # from the transfer on: asking which version to take is no refresh to pace
        try:
            versions = await self.sources.announced(stage, serving, self.following(time.monotonic()), self.probes)
            if (picked := self.sources.pick(stage, versions, copy.step + 1)) is None:
                return  # no two peers at one version now (a fast stage): asked again next period
            source, top = picked
            started = time.perf_counter()
            config, loop = self.peer.config, asyncio.get_running_loop()
            if copy.module is None:  # live from the first catch-up on: the stage's step deltas advance it
                settings = OptimizerSettings(config.lr, config.weight_decay, config.beta1, config.beta2)
                await loop.run_in_executor(None, copy.make_live, self.sources.template(stage), settings)
            start, nbytes = copy.step, 0
            while copy.step < top[0]:
                deltas = await request_deltas(
                    self.peer.mates.p2p, source, config.model, stage, copy.step, copy.parameter_count(), INFO_TIMEOUT
                )
                deltas = [d for d in deltas if d.step < top[0]]  # the source stepped past the confirmed version
                await loop.run_in_executor(None, copy.advance, deltas)
                self.deltas_applied += len(deltas)
                nbytes += sum(4 * d.grad_sum.numel() for d in deltas if d.grad_sum is not None)
            self.bytes_received += nbytes
            if (copy.step, copy.fingerprint) != top:
                self._missed(stage, source, top)
                return
            logger.info(
                f"Caught up the standby copy of stage {stage} to step {copy.step} (fingerprint {copy.fingerprint}) "
                f"with {copy.step - start} step deltas from {source}: {nbytes} bytes in "
                f"{time.perf_counter() - started:.2f}s ({self.bytes_received} bytes over {self.refreshes} "
                f"refreshes and {self.deltas_applied} deltas)"
            )
        except asyncio.CancelledError:
            raise
        except StageStateError as e:
            if takes_whole(e):  # none kept yet (the stage's peers keep them once asked): taken whole
                self.no_deltas[stage] = copy.step
            logger.info(f"Could not catch up the standby copy of stage {stage} at step {copy.step}: {e}")
        except Exception as e:
            logger.info(f"Could not catch up the standby copy of stage {stage}: {type(e).__name__}: {e}")
        finally:
            self.fetching.discard(stage)
            if stage in self.standbys and started is not None:  # not after a miss: a dropped copy is taken whole
                self.last_refresh[stage] = (time.monotonic(), time.perf_counter() - started)

    def _missed(self, stage: int, source: str, version: tuple[int, str]) -> None:
        copy = self.standbys.pop(stage, None) or self.standbys.get(stage)
        misses = self.sources.note_miss(stage, source)
        self.last_refresh.pop(stage, None)  # taken whole at the next look
        logger.warning(
            f"The step deltas of stage {stage} from {source} brought its standby copy to fingerprint "
            f"{copy.fingerprint} at step {copy.step}, not {version[1]} as two of its peers confirm (a source that "
            "lies, or peers computing on other devices); dropped the copy to take it whole"
            + (": from now on its copy is refreshed whole only" if misses >= MAX_DELTA_MISSES else "")
        )

    # --- restoring a stage ----------------------------------------------------------------------------

    def claim(self, stage: int) -> Standby | None:
        """The copy this peer restores `stage` from, if it is moving there to restore it (then it is no standby)."""
        pending, self.restore_pending = self.restore_pending, None
        return self.standbys.pop(stage, None) if pending == stage else None

    def restore_into(self, copy: Standby, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Loads a claimed copy into the lost stage's fresh module; `settle_restore` then tells the restore."""
        copy.apply(module, optimizer)
        self.claimed = (copy.stage, copy.step, parameter_fingerprint(module), time.monotonic())
        if copy.path is not None:
            copy.path.unlink(missing_ok=True)

    async def settle_restore(self) -> None:
        """Once announced on the stage it restored from its own copy: joins a live mate already past that copy, or
        takes a fresher copy another holder announces (a holder that is its stage's last peer never moves to
        restore, but gives its copy); else tells the restore of its own copy, in the ledger and the log."""
        if self.claimed is None:
            return
        (stage, step, fingerprint, restored_at), self.claimed = self.claimed, None
        newcomer = NewcomerRestore(self.peer, self.accused, self.sources.limits, dict(self.last_step), self.probes.live)
        if await newcomer.take_fresher(step, restored_at):
            return
        lost = max(0, self.last_step.get(stage, step) - step)
        self.restored.append((stage, step, lost))
        self.peer.ledger.write(restore_record(self.peer.peer_id, stage, step, step + lost))
        logger.warning(
            f"Restored stage {stage} from a standby at step {step} (lost {lost} steps); parameters {fingerprint}"
        )

    def move_failed(self) -> None:
        """The move to restore a stage did not happen: the next look decides again."""
        self.restore_pending = None

    async def fetch_for_newcomer(self, timeout: float = JOIN_RESTORE_TIMEOUT) -> bool:
        """Brings this peer's stage back from a standby copy (see `NewcomerRestore.fetch`); True if it did."""
        return await NewcomerRestore(self.peer, self.accused, self.sources.limits, dict(self.last_step)).fetch(timeout)
