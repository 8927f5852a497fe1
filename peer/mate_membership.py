"""Who this peer's stage-mates are, from the signed records, and who may speak on the mate protocols.

Membership is what a peer sees in the DHT (mates announced as serving), widened by every peer that
sent it progress or a contribution for the step and by the member lists those carry. A mate that
cannot be reached is left out of rounds until it shows a sign of life.

Mates are who the signed records say (`swarm.net.identity`): the mate protocols answer only a peer
whose libp2p-authenticated peer id has a record on this stage (joining, serving or leaving), and
refuse anyone else with FORBIDDEN before reading a byte. Peers of other stages whose records name
them as standby holders of this stage may ask for its state, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from hivemind.utils import get_dht_time

from swarm.net.allowlist import Handler
from swarm.net.transport import STATE_PROTOCOL
from swarm.peer.mate_messages import PROGRESS_TIMEOUT
from swarm.peer.protocol_handler import send_reply
from swarm.peer.step_machine import StepMachine
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, MateReply, StateReply
from swarm.records.accusations import AccusationBook, accusation_book
from swarm.records.stage_records import LEAVING, SERVING, StageRecord

logger = logging.getLogger(__name__)

MEMBER_MEMORY = 60.0  # seconds a peer seen with a record on the stage may still speak as a mate without one
REFRESH_INTERVAL = 1.0  # an unknown sender makes the peer re-read its stage's records at most this often
ACCUSATIONS_PERIOD = 2.0  # seconds between reads of the run's accusations
# seconds a mate found unreachable a second time stays out of rounds whatever it sends, doubling each time after
UNREACHABLE_HOLD = 10.0
UNREACHABLE_HOLD_MAX = 600.0
HOLDERS_REFRESH_INTERVAL = 5.0  # an unknown asker for state makes it re-read every stage at most this often
# seconds a peer that took this peer's state keeps hearing its progress, answering or not, until it announces
# itself: one still loading the state (a loaded host takes seconds) misses no holdings that its first answer
# would have carried, and one that never comes up is dropped then
NEWCOMER_GRACE = 60.0


class MateMembership:
    """The stage's members as this peer knows them, and the admission of mate messages."""

    def __init__(self, machine: StepMachine) -> None:
        self.machine = machine
        self.mates: dict[str, StageRecord] = {}
        # every peer seen with a signed record on this stage (joining, serving or leaving), when (loop time)
        # and in which state it last was: who may speak as a mate. Remembered a while, so that a record
        # lapsing under load does not shut a live mate out of the round under way.
        self.stage_peers: dict[str, tuple[float, str]] = {}
        # (step, parameter fingerprint) pairs each peer that left this stage last announced here (its LEAVING
        # record): a mover's last steps, which this peer's own steps must match or the ledger abandons
        self.leaving_versions: dict[str, tuple[tuple[int, str], ...]] = {}
        self.refresh_records: Callable[[], Awaitable[None]] | None = None  # re-reads the stage's records
        # peers of other stages whose signed records say they hold a standby copy of this stage
        # (`swarm.peer.standby`): they may download its state, and nothing else; kept up to date by the peer
        self.standby_holders: set[str] = set()
        # re-reads every stage's records, for standby holders (None: this peer keeps no standby copies)
        self.refresh_holders: Callable[[], Awaitable[None]] | None = None
        self.refused_outsiders = 0  # mate messages from peers no record puts on this stage
        # mates a round could not reach, and until when (loop time) a sign of life does not bring them back:
        # such a mate is left out of rounds until it sends something, so that a dead mate costs one failed
        # round, not one per step until its record expires. A renewed record is no sign of life: an identity
        # that renews a record and answers nothing (any key can) would cost a failed round every step. Each
        # time a mate is found unreachable again, it stays out longer (UNREACHABLE_HOLD, doubling)
        self.unreachable: dict[str, float] = {}
        self._unreachable_marks: dict[str, int] = {}
        # peers this peer gave its state to, until they announce themselves serving: they are members
        # from the step they took, and must hear this peer's progress before its backwards are answered
        self.newcomers: set[str] = set()
        self._newcomer_since: dict[str, float] = {}  # per newcomer: when (loop time) it took the state
        # mates that handed over and left the stage, each with its serving record's expiration then: that record,
        # read again before it lapses, makes no mate of it; a renewed one (it came back) does
        self.left: dict[str, float] = {}
        self.state_source: str | None = None  # the mate whose state this peer is downloading now
        self._holders_refresh: asyncio.Task | None = None
        self._holders_refreshed_at = float("-inf")
        self._refreshing: asyncio.Task | None = None
        self._refreshed_at = float("-inf")
        self._refresh_began = float("-inf")
        # in a swarm with a trust root: the peers vouched trainers' spot checks accused (`watch_accusations`).
        # An accused peer is no mate: left out of rounds, refused on the mate protocols, never a state source
        self.accusations: AccusationBook | None = None
        # peers this peer caught lying in a round itself (an owner's sum that its own audit refuted): no mates
        # of this peer from then on, as the accused are (a finding of its own, which no one else need believe)
        self.caught: dict[str, str] = {}
        self._dht = None
        self._accusations_read: asyncio.Task | None = None
        self._accusations_read_at = float("-inf")

    def watch_accusations(self, dht, trust_root: str | None, run_id: str) -> None:
        """Reads the run's accusations with every read of the records (at most every ACCUSATIONS_PERIOD)."""
        self.accusations = accusation_book(trust_root, run_id, f"Stage {self.machine.stage} peer")
        self._dht = dht

    @property
    def accused(self) -> dict:
        """The accused peers this peer knows of (each with the accusation that first held, or why this peer
        caught it)."""
        accused = self.accusations.accused if self.accusations is not None else {}
        return {**self.caught, **accused} if self.caught else accused

    def catch(self, peer_id: str, why: str) -> None:
        """`peer_id` was caught lying (`why`): out of this peer's rounds and state sources for good."""
        self.caught.setdefault(peer_id, why)
        self._forget(peer_id)

    def _forget(self, peer_id: str) -> None:
        """Drops an accused or caught peer from every list of who belongs to the stage."""
        self.mates.pop(peer_id, None)
        self.newcomers.discard(peer_id)
        self.stage_peers.pop(peer_id, None)
        self.leaving_versions.pop(peer_id, None)

    def _read_accusations(self) -> None:
        loop = self.machine.loop
        if self.accusations is None or loop is None or loop.time() < self._accusations_read_at + ACCUSATIONS_PERIOD:
            return
        if self._accusations_read is not None and not self._accusations_read.done():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # records taken in outside the event loop (a test): the next read on it goes
            return
        self._accusations_read_at = loop.time()

        async def read() -> None:
            try:
                new = await self.accusations.read(self._dht)
            except Exception as e:
                logger.debug(f"Could not read the run's accusations: {e}")
                return
            for peer_id in new:
                self._forget(peer_id)

        self._accusations_read = asyncio.ensure_future(read())

    async def read_accusations_now(self, timeout: float) -> None:
        """Reads the run's accusations now, waiting at most `timeout` seconds: mates whose views of a round
        differ may have read one that this peer has not. A read under way may predate it: one more follows."""
        if self.accusations is None:
            return
        deadline = self.machine.loop.time() + timeout
        for _ in range(2):
            under_way = self._accusations_read is not None and not self._accusations_read.done()
            if not under_way:
                self._accusations_read_at = float("-inf")
                self._read_accusations()
            if self._accusations_read is None:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._accusations_read), deadline - self.machine.loop.time())
            if not under_way:
                return

    def take_records(self, records: list[StageRecord]) -> set[str]:
        """Takes in the stage's records from the DHT; returns the mates that have just appeared."""
        machine = self.machine
        now = machine.loop.time() if machine.loop is not None else 0.0
        self._read_accusations()
        accused = self.accused
        records = [r for r in records if r.peer_id not in accused]
        for r in records:
            if r.peer_id != machine.peer_id and r.model == machine.model and r.num_stages == machine.num_stages:
                self.stage_peers[r.peer_id] = (now, r.state)
                if r.state == LEAVING:
                    self.leaving_versions[r.peer_id] = r.versions
                else:
                    self.leaving_versions.pop(r.peer_id, None)  # back on the stage: its steps are compared live
        for peer_id in [p for p, (seen, _) in self.stage_peers.items() if now - seen > MEMBER_MEMORY]:
            del self.stage_peers[peer_id]
        self.leaving_versions = {p: v for p, v in self.leaving_versions.items() if p in self.stage_peers}
        self.left = {p: expiration for p, expiration in self.left.items() if expiration > get_dht_time()}
        mates = {
            r.peer_id: r
            for r in records
            if r.peer_id != machine.peer_id
            and r.state == SERVING
            and r.model == machine.model
            and r.num_stages == machine.num_stages
            and r.expiration > self.left.get(r.peer_id, float("-inf"))
        }
        self._keep_missed(mates, {r.peer_id for r in records} | set(accused))
        for peer_id in list(self.unreachable):
            if peer_id in mates:
                del mates[peer_id]  # its record, renewed or not, is no sign of life
            elif peer_id not in self.stage_peers:
                del self.unreachable[peer_id]  # its record is gone: a peer that comes back is a newcomer
                self._unreachable_marks.pop(peer_id, None)
        new = set(mates) - set(self.mates)
        self.mates = mates
        self.newcomers -= set(mates)  # they hear progress as mates from now on
        return new

    def forked_leavers(self, step: int, fingerprint: str) -> dict[str, int]:
        """Peers that left this stage having announced `step` with parameters other than `fingerprint` (this
        peer's at `step`), each with that step. A mover that stepped on a round its mates had not finished, and
        left, took its step with it: a mate that then steps alone on another sum forks the stage's history."""
        return {
            peer_id: step
            for peer_id, versions in self.leaving_versions.items()
            if any(at == step and theirs and theirs != fingerprint for at, theirs in versions)
        }

    def _keep_missed(self, mates: dict[str, StageRecord], read: set[str]) -> None:
        """Keeps in `mates` each mate this read missed whose last record has not expired. A DHT read can come
        back short (a node that did not answer in time): without this, one short read could leave a lone
        liar as the only mate, whose word then goes unconfirmed. A dead mate's record lasts as long in a full
        read; a mate whose record now says it is no longer serving is in `read`, and is not kept."""
        now = get_dht_time()
        for peer_id, record in self.mates.items():
            if peer_id not in read and peer_id not in mates and record.expiration > now:
                mates[peer_id] = record

    def add_newcomer(self, peer_id: str) -> None:
        """`peer_id` took this peer's state to join the stage: a member from then on, told this peer's progress."""
        now = self.machine.loop.time() if self.machine.loop is not None else 0.0
        self.newcomers.add(peer_id)
        self._newcomer_since = {p: t for p, t in self._newcomer_since.items() if p in self.newcomers}
        self._newcomer_since[peer_id] = now

    def newcomer_silent(self, peer_id: str) -> None:
        """A progress message to `peer_id` failed. A newcomer is told on for `NEWCOMER_GRACE` after it took the
        state: dropped at once, it would hear nothing of this peer's holdings toward a later step until its record
        showed, and should this peer die meanwhile, those samples would be lost without anyone naming them."""
        since = self._newcomer_since.get(peer_id)
        now = self.machine.loop.time() if self.machine.loop is not None else 0.0
        if since is None or now - since > NEWCOMER_GRACE:
            self.newcomers.discard(peer_id)
            self._newcomer_since.pop(peer_id, None)

    def mark_left(self, peer_id: str) -> None:
        """`peer_id` handed over: it left the stage (a move, a stop). Out of later rounds at once, and while the
        record it served under lasts: a mover lives on, so no probe of it fails, and a call to it is refused
        only after its new stage re-reads the records."""
        self.newcomers.discard(peer_id)
        record = self.mates.pop(peer_id, None)
        if record is not None:
            self.left[peer_id] = record.expiration

    def departed(self) -> set[str]:
        """Peers that handed over and left this stage (`mark_left`) and have not served it again since: no progress
        goes to them. On its new stage a mover refuses a mate message only after re-reading the records there, and
        a backward waits for its progress to be delivered: a mate told on after the move held backwards 1 s."""
        return set(self.left) - set(self.mates)

    def mark_unreachable(self, peer_id: str) -> None:
        """Leaves a mate that could not be reached out of later rounds until it shows a sign of life (once it
        has been found unreachable before, not before a hold that doubles each time)."""
        self.newcomers.discard(peer_id)
        if self.mates.pop(peer_id, None) is None:
            return
        marks = self._unreachable_marks.get(peer_id, 0) + 1
        self._unreachable_marks[peer_id] = marks
        hold = 0.0 if marks == 1 else min(UNREACHABLE_HOLD * 2 ** (marks - 2), UNREACHABLE_HOLD_MAX)
        now = self.machine.loop.time() if self.machine.loop is not None else 0.0
        self.unreachable[peer_id] = now + hold

    def heard_from(self, peer_id: str) -> None:
        """A mate sent something: it is reachable (it rejoins the rounds with the next read of the records),
        unless it is still held out for having been unreachable again and again."""
        until = self.unreachable.get(peer_id)
        now = self.machine.loop.time() if self.machine.loop is not None else 0.0
        if until is not None and now >= until:
            del self.unreachable[peer_id]

    def is_member(self, peer_id: str) -> bool:
        """Whether `peer_id` belongs to the stage as this peer knows it now (no read of the records)."""
        if peer_id in self.accused:
            return False
        return (
            peer_id in self.stage_peers
            or peer_id in self.mates
            or peer_id in self.newcomers
            or peer_id == self.state_source
        )

    def joins_stage(self, requester: str) -> bool:
        """Whether a peer asking for the stage's state takes part in the stage (not a standby copy only).

        A standby holder takes a copy and stays out of the stage: no round waits for it. So does a peer
        that left this stage for another (it handed over, or its last record here says LEAVING): it is a
        holder there, which this peer learns only at its next read of every stage.
        """
        left = self.stage_peers.get(requester, (0.0, ""))[1] == LEAVING or requester in self.left
        left = left and requester not in self.mates
        return not (left or (requester in self.standby_holders and not self.is_member(requester)))

    # --- who may speak as a mate ------------------------------------------------------------------------

    def members_only(self, handler: Handler, protocol: str) -> Handler:
        """`handler` for peers the signed records put on this stage; anyone else is refused unread."""
        machine = self.machine

        async def guarded(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sender = str(stream_info.peer_id)
            standby = protocol == STATE_PROTOCOL and sender in self.standby_holders
            if standby or await self._admits(sender) or (protocol == STATE_PROTOCOL and await self._new_holder(sender)):
                await handler(stream_info, reader, writer)
                return
            self.refused_outsiders += 1
            if self.refused_outsiders in (1, 10, 100) or self.refused_outsiders % 1000 == 0:
                logger.warning(
                    f"Refused {self.refused_outsiders} stage-mate message(s), lately on {protocol} from {sender}: "
                    f"no signed record puts it on stage {machine.stage}"
                )
            error = Error(code=ErrorCode.FORBIDDEN, message=f"no signed record puts {sender} on stage {machine.stage}")
            if protocol == STATE_PROTOCOL:
                reply = StateReply(protocol_version=PROTOCOL_VERSION, error=error)
            else:
                reply = MateReply(protocol_version=PROTOCOL_VERSION, step=machine.runtime.step, error=error)
            await send_reply(reader, writer, [reply], "a stage-mate")

        return guarded

    async def _admits(self, peer_id: str) -> bool:
        """Whether `peer_id` has a record on this stage. An unknown one makes the peer re-read the records
        (a newcomer asks for state right after announcing itself): one read at a time, at most every
        `REFRESH_INTERVAL`, shared by every handler waiting, and one that began after the caller arrived."""
        if self.is_member(peer_id):
            return True
        if self.refresh_records is None:
            return False
        loop = self.machine.loop
        arrived = loop.time()
        for _ in range(2):
            if self._refreshing is None or self._refreshing.done():
                delay = max(0.0, self._refreshed_at + REFRESH_INTERVAL - loop.time())
                self._refreshing = asyncio.ensure_future(self._refresh_once(delay))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._refreshing), PROGRESS_TIMEOUT + REFRESH_INTERVAL)
            if self.is_member(peer_id):
                return True
            if self._refresh_began >= arrived:
                break  # a read that began after the caller arrived did not find it: no record
        return False

    async def _new_holder(self, peer_id: str) -> bool:
        """Whether `peer_id` holds a standby copy of this stage that the last read of every stage did not show (a
        new holder asks for state right after announcing itself): one such read at a time, and at most every
        `HOLDERS_REFRESH_INTERVAL`, so that strangers asking for state cannot make the peer read the DHT at will."""
        if self.refresh_holders is None:
            return False
        loop = self.machine.loop
        if self._holders_refresh is None or self._holders_refresh.done():
            if loop.time() < self._holders_refreshed_at + HOLDERS_REFRESH_INTERVAL:
                return False
            self._holders_refreshed_at = loop.time()
            self._holders_refresh = asyncio.ensure_future(self.refresh_holders())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._holders_refresh), PROGRESS_TIMEOUT + REFRESH_INTERVAL)
        return peer_id in self.standby_holders

    async def _refresh_once(self, delay: float) -> None:
        loop = self.machine.loop
        await asyncio.sleep(delay)
        self._refresh_began = loop.time()
        try:
            await self.refresh_records()
        except Exception as e:
            logger.debug(f"Could not re-read stage {self.machine.stage}'s records: {e}")
        finally:
            self._refreshed_at = loop.time()
