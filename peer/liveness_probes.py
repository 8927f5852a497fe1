"""Which peers named in records answer when asked: a stage whose peers died shows lost before their records lapse.

A record outlives its peer by up to the record TTL (10 s by default), and a stage counts as lost only when no
record shows a peer on it, so without probes a standby holder starts restoring a stage well after its last
peer died. Each announce period a holder asks the peers that records put on the stages it holds copies of
(and the holder chosen to restore a lost one) what they host, over the info protocol; in the calm, only those
whose records a read has shown unrenewed for a period (`stalled`): a live peer renews every period. A peer
that failed to answer since its record was last renewed is left out of the records the holder decides on; a
record renewed after the failed probe counts again, so a slow answer costs at most one period of a wrong
view, never a peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from swarm.net.transport import INFO_PROTOCOL, exchange, nothing_listens
from swarm.net.wire import WireLimits
from swarm.policy.empty_stages import coming
from swarm.proto import PROTOCOL_VERSION, PeerInfo, PeerInfoRequest
from swarm.records.stage_records import JOINING, LEAVING, SERVING, StageRecord

logger = logging.getLogger(__name__)

SILENCE_MEMORY = 60.0  # seconds a failed probe is remembered (its peer's record lapses long before)


class LivenessProbes:
    """Probes peers named in records, and leaves the ones that failed since their last renewal out of records."""

    def __init__(self, record_ttl: float, timeout: float) -> None:
        self.record_ttl = record_ttl
        self.timeout = timeout
        self.silent: dict[str, float] = {}  # peer id -> DHT time of its last failed probe
        self.answered: dict[str, float] = {}  # peer id -> DHT time of its last answered probe
        # peer id -> its record's expiration at the first read after that failure: a renewal shows a later one.
        # (Not the expiration less this peer's own --record-ttl: another peer's TTL may differ, and a longer own
        # one would date every renewal too early and keep a live peer out of view.)
        self.expiration_at_failure: dict[str, float] = {}
        # peer id -> (its record's expiration, when a read first showed it): a record not renewed for a period
        # (`stalled`) is its peer's first sign of death, TTLs and clocks aside
        self.renewals: dict[str, tuple[float, float]] = {}
        self.in_flight = False  # one round of probes at a time: a slow one must not pile up behind the next
        self.round_ended = asyncio.Event()  # set while no round is in flight
        self.round_ended.set()
        # peer id -> its last answer (sent at `answered`): what the peer hosts, at which step and fingerprint, which
        # a standby holder following a stage would otherwise ask the same peer for again
        self.infos: dict[str, PeerInfo] = {}
        # peers whose last failed probe was a refused dial: nothing listens where they were, which no slow answer on
        # a loaded host looks like, so a stage whose every peer refused counts as lost without a grace
        self.refused: set[str] = set()
        self.news = asyncio.Event()  # a probe found a peer newly silent: its keeper reads again at once
        self.probes = 0
        self.failures = 0

    def stalled(self, records: Iterable[StageRecord], period: float, now: float | None = None) -> set[str]:
        """Notes each record's renewal; returns the peers whose records a read has shown unrenewed for at least
        `period` seconds (this peer's announce period: a live peer renews once a period). A peer that announces
        less often, or whose renewal is slow to spread, shows up here too, and is only asked once more."""
        now = time.monotonic() if now is None else now
        stalled = set()
        for record in records:
            expiration, since = self.renewals.get(record.peer_id, (float("-inf"), now))
            if record.expiration > expiration:
                self.renewals[record.peer_id] = (record.expiration, now)
            elif now - since >= period:
                stalled.add(record.peer_id)
        self.renewals = {p: (e, at) for p, (e, at) in self.renewals.items() if now - at < SILENCE_MEMORY}
        return stalled

    async def probe(self, p2p: P2P, peers: Iterable[str]) -> None:
        """Asks each of `peers` what it hosts, at once; notes which failed to answer within the timeout."""
        peers = list(dict.fromkeys(peers))
        if not peers:
            return
        started = get_dht_time()
        self.in_flight = True
        self.round_ended.clear()
        try:
            answers = await asyncio.gather(*(self._ask(p2p, p) for p in peers), return_exceptions=True)
        finally:
            self.in_flight = False
            self.round_ended.set()
        self.probes += len(peers)
        for peer_id, answer in zip(peers, answers):
            if isinstance(answer, BaseException):
                self.failures += 1
                self._failed(peer_id, started, refused=nothing_listens(p2p, peer_id, answer))
            else:
                self.expiration_at_failure.pop(peer_id, None)
                self.silent.pop(peer_id, None)
                self.refused.discard(peer_id)
                self.answered[peer_id] = started
                self.infos[peer_id] = answer
        self.silent = {p: at for p, at in self.silent.items() if started - at < SILENCE_MEMORY}
        self.answered = {p: at for p, at in self.answered.items() if started - at < SILENCE_MEMORY}
        self.expiration_at_failure = {p: e for p, e in self.expiration_at_failure.items() if p in self.silent}
        self.refused &= self.silent.keys()
        self.infos = {p: info for p, info in self.infos.items() if p in self.answered}

    async def answers(self, peers: Iterable[str], since: float) -> dict[str, PeerInfo]:
        """What each of `peers` answered to a probe sent at DHT time `since` or later (a round in flight is waited
        for, a timeout at most); the peers with no such answer are left out."""
        await self.round_ended.wait()
        return {p: self.infos[p] for p in peers if p in self.infos and self.answered[p] >= since}

    async def _ask(self, p2p: P2P, peer_id: str) -> PeerInfo:
        # any reply counts, an error too (a busy gate, another protocol version): only silence is a failure
        request = PeerInfoRequest(protocol_version=PROTOCOL_VERSION)
        call = exchange(p2p, PeerID.from_base58(peer_id), INFO_PROTOCOL, [request], PeerInfo, WireLimits())
        try:
            info, _ = await asyncio.wait_for(call, self.timeout)
        except Exception as e:
            # a death seen before the peer's process is gone (its daemon resets the stream): settled where it served
            confirm = getattr(p2p, "confirm_refusal", None)
            if confirm is not None and not nothing_listens(p2p, peer_id, e):
                await confirm(peer_id)
            raise
        return info

    def note_refused(self, peer_id: str) -> None:
        """Counts a refusal seen by another call to `peer_id` (its direct address, which answered before, refused a
        connection since) as a failed probe of it now, refused: its keeper reads again at once."""
        self._failed(peer_id, get_dht_time(), refused=True)

    def _failed(self, peer_id: str, at: float, refused: bool) -> None:
        """Notes that `peer_id` failed a probe sent at DHT time `at` (its dial `refused`, or not); news if newly."""
        self.expiration_at_failure.pop(peer_id, None)
        if peer_id not in self.silent:
            self.news.set()
        self.silent[peer_id] = at
        (self.refused.add if refused else self.refused.discard)(peer_id)

    def take_news(self) -> bool:
        """Whether a probe found a peer newly silent since the last call."""
        news = self.news.is_set()
        self.news.clear()
        return news

    async def until_news(self, period: float) -> None:
        """Waits `period` seconds, or less: until a probe finds a peer newly silent (its stage may be lost)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.news.wait(), period)

    def verdict(self, peer_id: str, since: float) -> bool | None:
        """Whether `peer_id` answered (True) or failed (False) a probe sent at DHT time `since` or later; None if
        no such probe has ended yet."""
        if self.silent.get(peer_id, float("-inf")) >= since:
            return False
        if self.answered.get(peer_id, float("-inf")) >= since:
            return True
        return None

    def dead(self, record: StageRecord) -> bool:
        """Whether `record`'s peer failed a probe sent after the record was last renewed. A LEAVING record is never
        dead: it says the peer went on request, which a holder must still read (that stage is not restored)."""
        failed_at = self.silent.get(record.peer_id) if record.state != LEAVING else None
        if failed_at is None:
            return False
        if record.expiration - self.record_ttl > failed_at:  # renewed after the probe even by this peer's TTL
            return False
        first = self.expiration_at_failure.setdefault(record.peer_id, record.expiration)
        return record.expiration <= first

    def all_refused(self, records: Iterable[StageRecord]) -> bool:
        """Whether every serving or joining peer among `records` refused its last probe's dial (see `refused`)."""
        named = [r.peer_id for r in records if r.state in (SERVING, JOINING)]
        return bool(named) and all(p in self.refused for p in named)

    def on_the_way(self, stage: int, records: dict[int, list[StageRecord]]) -> set[str]:
        """The peers whose leaving records name `stage` as their target (a restorer or a filler on its way there)
        and that failed no probe sent after their record was last renewed: one killed on its way brings nothing."""
        failed = self.silent.get
        return {
            r.peer_id
            for r in coming(stage, records)
            if failed(r.peer_id, float("-inf")) < r.expiration - self.record_ttl
        }

    def live(self, records: dict[int, list[StageRecord]]) -> dict[int, list[StageRecord]]:
        """`records` without those of peers that failed a probe since their last renewal."""
        if not self.silent:
            return records
        return {stage: [r for r in group if not self.dead(r)] for stage, group in records.items()}
