"""A newcomer on a stage that no live peer serves: it brings the stage back from a standby copy.

A peer that joins an empty stage (a newcomer with `--stage auto` picks one first) takes the freshest copy
from a holder over `STANDBY_PROTOCOL`, which answers only a peer whose signed record is on that stage, and
whose copy must match what the holder's record announces: a copy follows its stage between the holder's renewals, so
the holder stores its record before it gives the copy, and the newcomer takes a later version than the one it read
where the holder's record says so at a read after the reply. Where a live peer serves the stage again (a
holder or a filler restored it meanwhile), the newcomer takes that peer's state instead; where no copy is
left, it serves the stage from its own state and the sample ledger says what was thrown away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from hivemind.p2p import PeerID

from swarm.net.transport import STANDBY_PROTOCOL, exchange
from swarm.net.wire import WireLimits, decode_tensors, pack_frames
from swarm.peer.stage_state import StageStateError, check_state_tensors
from swarm.peer.standby_copy import Standby
from swarm.peer.standby_host import StandbyHost
from swarm.peer.state_transfer import encode_state, load_into_runtime, parameters_fingerprint
from swarm.policy.empty_stages import coming, coming_copy, on_the_way
from swarm.policy.lost_stages import reached_step, standby_copies
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, StateReply, StateRequest
from swarm.records.sample_ledger import restore_record
from swarm.records.stage_records import JOINING, SERVING, StageRecord

logger = logging.getLogger(__name__)

STATE_TIMEOUT = 120.0
JOIN_RESTORE_TIMEOUT = 90.0  # how long a peer on an empty stage tries for a standby copy before a fresh start
JOIN_RETRY_S = 2.0
SHORT_READ_RETRIES = 3  # reads a peer on an empty stage makes when the swarm has trained but shows no copy of it
RIVAL_PERIODS = 5  # announce periods a restorer waits for a rival restorer it gives way to to serve its state
RIVAL_WINDOW = 0.5  # announce periods from a restore to its first look for a rival: its leaving record is out by then


class NewcomerRestore:
    """One newcomer's attempt to bring its empty stage back (`fetch`), for a standby keeper's peer."""

    def __init__(
        self,
        peer: StandbyHost,
        accused: Callable[[], set[str]],
        limits: Callable[[int], WireLimits],
        seen: dict[int, int] | None = None,
        live: Callable[[dict[int, list[StageRecord]]], dict[int, list[StageRecord]]] = lambda records: records,
    ) -> None:
        self.peer = peer
        self.live = live  # records less those of peers its keeper's probes found dead (`LivenessProbes.live`)
        self.accused = accused  # peers a vouched trainer accused: never a source
        self.limits = limits  # per stage: the size limits of its state on the wire
        # per stage, the furthest step this peer saw announced before (its keeper's notes): a peer that moves to
        # fill a stage whose records expired with its peers still knows how far that stage had got
        self.seen = seen or {}

    def _reached(self, stage: int, records: dict[int, list[StageRecord]], step: int) -> int:
        """How far `stage` had got: the furthest of its records and of what this peer saw it announce."""
        return max(reached_step(stage, records, step), self.seen.get(stage, step))

    async def fetch(self, timeout: float = JOIN_RESTORE_TIMEOUT) -> bool:
        """Brings this peer's stage back, which no live mate could give state for; True if it did.

        Tries the freshest standby copy first, then every other. While a copy is announced but cannot be had
        yet (its holder does not see this peer's record yet, or refreshed it meanwhile), or a holder is on
        its way to restore the stage, it tries again, up to `timeout`. If no copy is in sight but other
        stages have stepped past this peer, it reads a few times more (a DHT read may come back short).
        A peer that served the stage at a fresh start instead would throw away the stage's progress, and
        the holders would see no lost stage to restore. In a new swarm it returns at once: a read that shows
        no stage past this peer's step and this peer's own record (announced before it reads). A read without
        that record came back short (a DHT under load): a wave run's newcomers took such reads for a new swarm
        and served two stages from step 0, silently.
        """
        peer = self.peer
        stage = peer.stage
        deadline = time.monotonic() + timeout
        reads = 0
        while True:
            records = await peer._fetch_records()
            peer.mates.update_records(records[stage])
            if any(r.step > peer.runtime.step for r in peer.mates.mates.values()):
                # a mate serves the stage again (a holder that restored it): its state, as any joiner takes it
                if await peer.mates.sync_from_mates(minimum_step=peer.runtime.step + 1) is not None:
                    return True
            copies = self._copies_past(records, peer.runtime.step)
            # a holder on its way to restore the stage brings a fresher copy: its state once it serves, not an older
            # one (a p3 replay: a newcomer served from step 192 beside a restorer's 194, and a backward it answered
            # was lost unsaid when it took the restorer's state and died)
            if (coming := coming_copy(stage, records)) is not None:
                copies = {p: c for p, c in copies.items() if c[0] >= coming}
            if await self._take_a_copy(copies, records):
                return True
            # stages step together: if any has stepped past this peer, so had this one; before concluding that
            # its copies died with it, read again a few times (a DHT read can come back short)
            trained = any(r.step > peer.runtime.step for group in records.values() for r in group)
            whole = any(r.peer_id == peer.peer_id for r in records.get(stage, []))
            if not copies and not on_the_way(stage, records):
                if not trained and whole:
                    return False
                if reads >= SHORT_READ_RETRIES:
                    logger.error(
                        f"Stage {stage}: other stages have trained, but no standby copy of this one is announced "
                        f"(its holders died with it?); serving it from step {peer.runtime.step}"
                    )
                    return await self._start_over(records)
            if not trained and not whole and reads == 0:
                logger.warning(f"Stage {stage}: the swarm's records came back without this peer's own; reading again")
            reads += 1
            if time.monotonic() > deadline:
                logger.error(
                    f"Stage {stage}: no standby copy could be had in {timeout:.0f}s; serving it from step "
                    f"{peer.runtime.step}: its progress since is lost"
                )
                return await self._start_over(records)
            await asyncio.sleep(JOIN_RETRY_S)

    async def take_fresher(self, step: int, restored_at: float) -> bool:
        """For a holder that restored this peer's stage from its own copy of `step`: takes the state of a live mate
        already past it, or a fresher copy another holder gives; True if either (that restore then does not count).

        Holders choose the restorer from records a period old, so two can restore one stage at once (a wave run:
        copies of steps 122 and 123, then two of step 124), and two restored histories fork the stage. A holder
        whose rival restored a later step, or the same step with the smaller peer id, takes the rival's state once
        it serves, for up to `RIVAL_PERIODS` announce periods. A rival read the records before this peer's leaving
        record was out, and stores its own (naming this stage and listing its copy) right after its read: the
        first look, `RIVAL_WINDOW` announce periods after the restore (`restored_at`, monotonic), which came after
        this peer's leaving record, sees it on its way if not yet on the stage. Without a rival it serves at once
        (it waited a whole announce period for one: a second of every restore in a p3 replay), unless its copy is
        behind the step the stage had reached: a holder that caught its copy up just before the stage died tells so
        at its next renewal, so the restorer looks for a fresher copy once more a period after its restore."""
        peer = self.peer
        period = peer.config.announce_period
        await asyncio.sleep(max(0.0, restored_at + RIVAL_WINDOW * period - time.monotonic()))
        copy_looks = 1  # two where its copy is behind the stage's reached step
        for look in range(RIVAL_PERIODS + 1):
            records = await peer._fetch_records()
            # a dead peer's record outlives it: one its keeper's probes found dead is no rival, and gives no copy
            live = self.live(records)
            peer.mates.update_records(live[peer.stage])
            on_stage = any(self._wins_over(r, r.step, step) for r in live[peer.stage] if r.state in (JOINING, SERVING))
            if on_stage and await peer.mates.sync_from_mates(minimum_step=step) is not None:
                return True
            if look == 0 and self._reached(peer.stage, records, step) > step:
                copy_looks = 2
            if look < copy_looks and await self._take_a_copy(self._copies_past(live, step), records):
                return True
            again = look + 1 < copy_looks
            if not on_stage and not self._winner_coming(live, step) and not again:
                return False
            await asyncio.sleep(max(0.0, restored_at + period - time.monotonic()) if again else period)
        return False

    def _winner_coming(self, records: dict[int, list[StageRecord]], step: int) -> bool:
        """Whether a holder on its way to this peer's stage brings a copy this restore of `step` gives way to."""
        stage = self.peer.stage
        return any(
            self._wins_over(r, copy[0], step)
            for r in coming(stage, records)
            if (copy := r.standby_of(stage)) is not None
        )

    def _wins_over(self, record: StageRecord, its_step: int, step: int) -> bool:
        """Whether the peer of `record`, at `its_step` on this stage, has the state this restore of `step` should
        give way to: a later step, or the same one and the smaller peer id."""
        me = self.peer.peer_id
        if record.peer_id == me or record.peer_id in self.accused():
            return False
        return its_step > step or (its_step == step and record.peer_id < me)

    def _copies_past(self, records: dict[int, list[StageRecord]], step: int) -> dict[str, tuple[int, str]]:
        """The copies of this peer's stage that holders announce past `step`, none from an accused holder."""
        copies = standby_copies(self.peer.stage, records)
        return {p: c for p, c in copies.items() if c[0] > step and p not in self.accused()}

    async def _start_over(self, records: dict[int, list[StageRecord]]) -> bool:
        """The stage goes on from this peer's own state, with no copy: the ledger says so, as for a restore,
        so that the progress thrown away is counted by id rather than as divergent replicas. Returns False.
        Unless a live peer serves the stage (one that restored it, whose state this peer could not have yet, as
        it did not see this peer's record): this peer then takes that state as training goes, and nothing is lost."""
        peer = self.peer
        step = peer.runtime.step
        if await peer.mates.another_serves():
            logger.warning(
                f"Stage {peer.stage}: a live peer serves it, but gave no state yet; taking it as training goes"
            )
            return False
        reached = self._reached(peer.stage, records, step)
        if reached <= step:  # the stage's own records are gone: the other stages say how far training went
            reached = max((r.step for group in records.values() for r in group), default=step)
        peer.ledger.write(restore_record(peer.peer_id, peer.stage, step, reached))
        return False

    async def _take_a_copy(self, copies: dict[str, tuple[int, str]], records: dict[int, list[StageRecord]]) -> bool:
        """Downloads the freshest of `copies` (holder -> (step, fingerprint)) that a holder gives; True if one."""
        stage = self.peer.stage
        counts = Counter(copies.values())
        # the freshest copy first (holders refresh at different moments, so copies rarely agree); at one
        # step, the version more holders announce. Each holder took its copy only once two of the stage's
        # peers confirmed it, and the state sent must match what the holder's signed record announces.
        for version in sorted(counts, key=lambda v: (v[0], counts[v]), reverse=True):
            for holder in sorted(p for p, c in copies.items() if c == version):
                try:
                    step, fingerprint = await self._download_from_holder(holder, version)
                except Exception as e:
                    logger.warning(f"Could not take stage {stage}'s standby copy from {holder}: {e}")
                    continue
                if await self._served_again(stage, step):
                    return True
                lost = self._reached(stage, records, step) - step
                self.peer.ledger.write(restore_record(self.peer.peer_id, stage, step, step + lost))
                logger.warning(
                    f"Restored stage {stage} from a standby at step {step} (lost {lost} steps); "
                    f"parameters {fingerprint}, taken from {holder}"
                )
                return True
        return False

    async def _served_again(self, stage: int, step: int) -> bool:
        """Whether a live peer serves `stage` again past `step` (a holder or a filler restored it while this peer
        took its copy): then this peer takes that peer's state and joins its history rather than starting one.
        A record alone says nothing here: the dead peers' records outlive them."""
        peer = self.peer
        records = await peer._fetch_records(only=stage)
        if not any(r.step > step and r.state in (SERVING, JOINING) for r in records[stage]):
            return False
        peer.mates.update_records(records[stage])
        source = await peer.mates.sync_from_mates(minimum_step=step + 1)
        if source is not None:
            logger.info(f"Stage {stage} is served again by {source}, past the copy of step {step}: took its state")
        return source is not None

    async def _download_from_holder(self, holder: str, version: tuple[int, str]) -> tuple[int, str]:
        peer = self.peer
        stage, runtime = peer.stage, peer.runtime
        limits = self.limits(stage)
        request = StateRequest(protocol_version=PROTOCOL_VERSION, model=peer.config.model, stage=stage)
        reply, parts = await asyncio.wait_for(
            exchange(peer.mates.p2p, PeerID.from_base58(holder), STANDBY_PROTOCOL, [request], StateReply, limits),
            STATE_TIMEOUT,
        )
        if reply.error.code != ErrorCode.OK:
            raise StageStateError(f"{ErrorCode.Name(reply.error.code)}: {reply.error.message}")
        tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, limits)
        check_state_tensors(runtime.module, tensors, reply.has_optimizer_state)
        fingerprint = await parameters_fingerprint(runtime.module, tensors)
        sent = (reply.step, fingerprint)
        if sent != version:
            # a holder announces the version it gives before it gives it (`answer_standby`): a copy that moved on
            # since this peer's read is taken where the holder's signed record says so now, and only a later one
            now = await self._announced_now(holder) if reply.step > version[0] else None
            if now != sent:
                said = f"says {now}" if now is not None else f"said {version}"
                raise StageStateError(f"sent step {reply.step}, fingerprint {fingerprint}; its record {said}")
        await load_into_runtime(runtime, reply.step, tensors, reply.has_optimizer_state, reply.samples_stepped)
        peer.mates.progress.reached(reply.step)
        return reply.step, fingerprint

    async def _announced_now(self, holder: str) -> tuple[int, str] | None:
        """The copy of this peer's stage that `holder`'s record announces at a read now (None: none announced)."""
        records = self.live(await self.peer._fetch_records())
        return standby_copies(self.peer.stage, records).get(holder)


async def answer_standby(
    peer: StandbyHost, copies: dict[int, Standby], requester: str, request: StateRequest, _parts, reply: StateReply
) -> list:
    """A holder's answer to a peer asking over `STANDBY_PROTOCOL` for its copy of a stage: the copy, if the asker's
    signed record is on that stage (a newcomer on an empty stage, a restorer), else the refusal."""
    copy = copies.get(request.stage)
    error = None
    if request.protocol_version != PROTOCOL_VERSION:
        error = Error(code=ErrorCode.VERSION_MISMATCH, message=f"this peer speaks protocol {PROTOCOL_VERSION}")
    elif request.model != peer.config.model or copy is None:
        error = Error(code=ErrorCode.WRONG_STAGE, message=f"no standby copy of stage {request.stage} here")
    else:
        records = await peer._fetch_records(only=copy.stage)
        on_stage = {r.peer_id for r in records[copy.stage] if r.state in (JOINING, SERVING)}
        if requester not in on_stage:
            error = Error(code=ErrorCode.FORBIDDEN, message=f"no signed record puts {requester} on stage {copy.stage}")
    if error is not None:
        reply.error.CopyFrom(error)
        return [reply]
    tensors, step, fingerprint, samples, has_optimizer_state = await asyncio.get_running_loop().run_in_executor(
        None, copy.snapshot
    )
    parts = await encode_state(tensors)
    # the asker takes only a version this peer's signed record announces, and a copy that follows its stage moves
    # on between renewals (a p3 replay: holders sent step 144 while their records said 140 and 142, both refused):
    # the record goes out now, listing the version given, before the copy does
    try:
        await peer._announce()
    except Exception as e:  # the asker then checks the copy against the record it read, which may be older
        logger.warning(f"Could not announce this peer's record before giving a standby copy of stage {copy.stage}: {e}")
    given = StateReply(
        protocol_version=PROTOCOL_VERSION, step=step, has_optimizer_state=has_optimizer_state, samples_stepped=samples
    )
    logger.info(f"Giving the standby copy of stage {copy.stage} (step {step}, {fingerprint}) to {requester}")
    return pack_frames(given, parts)
