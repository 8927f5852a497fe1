"""Peers of the stages a standby keeper follows that cannot be dialled: dead, whatever their records still say.

A killed peer's record outlives it by its TTL (10 s by default), so a stage whose every peer died looks lost
only once their records expire, and its restorer would first try to take those dead peers' state. While the
swarm shows churn, a keeper asks the peers of the stages it holds copies of whether they live, every announce
period. A peer that cannot be dialled at all (its address refuses, every dial fails) is dead now: its stage is
found lost seconds sooner. A peer that answers, or is merely slow to (a timeout), is alive as far as this goes,
and is taken out of the set at its next answer: the stage is then not lost, and nothing was restored yet (a
stage counts as lost only after `LOST_GRACE` periods of looking so, each with its own probe).
"""

from __future__ import annotations

import asyncio
import time

from hivemind.p2p import P2P, PeerID

from swarm.net.transport import StageCallError, get_peer_info
from swarm.proto import ErrorCode
from swarm.records.stage_records import StageRecord

DIAL_FAILURES = ("dial", "refused")  # what a call to a peer whose process and daemon are gone fails with


def cannot_dial(error: BaseException) -> bool:
    """Whether a call failed because the peer could not be reached at all (not a timeout, not a refusal)."""
    if not isinstance(error, StageCallError) or error.code != ErrorCode.UNAVAILABLE:
        return False
    detail = error.detail.lower()
    return "no reply within" not in detail and any(word in detail for word in DIAL_FAILURES)


class UndialablePeers:
    """The peers of followed stages that the last probe of each could not dial: peer id -> (stage, since)."""

    def __init__(self) -> None:
        self.since: dict[str, tuple[int, float]] = {}
        self.probing: set[int] = set()  # stages whose probe is under way

    async def probe(self, p2p: P2P, stage: int, peers: list[str], timeout: float) -> None:
        """Asks each of `stage`'s `peers` whether it lives, and notes which cannot be dialled."""
        self.probing.add(stage)
        try:
            answers = await asyncio.gather(
                *(get_peer_info(p2p, PeerID.from_base58(p), timeout=timeout) for p in peers), return_exceptions=True
            )
        finally:
            self.probing.discard(stage)
        now = time.monotonic()
        for peer_id, answer in zip(peers, answers):
            if isinstance(answer, BaseException) and cannot_dial(answer):
                self.since.setdefault(peer_id, (stage, now))
            else:
                self.since.pop(peer_id, None)

    def alive(self, records: dict[int, list[StageRecord]]) -> dict[int, list[StageRecord]]:
        """`records` without those of peers found undialable, and forgets peers whose records are gone."""
        for peer_id, (stage, _) in list(self.since.items()):
            if stage in records and all(r.peer_id != peer_id for r in records[stage]):
                del self.since[peer_id]
        return {stage: [r for r in group if r.peer_id not in self.since] for stage, group in records.items()}
