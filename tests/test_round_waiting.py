"""How a round decides a member it waits for is gone, from what a probe of it gives back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from swarm.net.transport import StageCallError
from swarm.peer import round_waiting
from swarm.peer.round_waiting import SILENT_PROBES, RoundWaiting
from swarm.proto import ErrorCode, PeerInfo

MATE = "QmPeerMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMM"


class Membership:
    def __init__(self) -> None:
        self.dropped: list[str] = []

    def mark_unreachable(self, peer_id: str) -> None:
        self.dropped.append(peer_id)


def probe_with(monkeypatch, answers: list) -> tuple[list[str], set[str]]:
    """Probes MATE once per answer (a PeerInfo, or a StageCallError raised): the members dropped, and `gone`."""
    replies = iter(answers)

    async def get_peer_info(p2p, peer_id, timeout):  # the probe's one call, answered as the case needs
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    monkeypatch.setattr(round_waiting, "get_peer_info", get_peer_info)

    async def go() -> tuple[list[str], set[str]]:
        machine = SimpleNamespace(stage=1, p2p=None, changed=asyncio.Event())
        membership = Membership()
        waiting = RoundWaiting(machine, membership, 30.0)
        gone: set[str] = set()
        for _ in answers:
            await waiting._probe(5, MATE, gone)
        return membership.dropped, gone

    return asyncio.run(go())


SILENT = StageCallError(ErrorCode.UNAVAILABLE, "no reply within 5.0s", MATE)
REFUSED = StageCallError(ErrorCode.UNAVAILABLE, "ControlFailure: connect: connection refused", MATE)


@pytest.mark.parametrize(
    ("answers", "dropped"),
    [
        ([PeerInfo(stage=1, state="serving")], False),
        ([REFUSED], True),
        ([SILENT], False),  # slow once: no sign of death
        ([SILENT, PeerInfo(stage=1), SILENT], False),  # an answer in between resets the count
        ([SILENT] * SILENT_PROBES, True),
        ([PeerInfo(stage=2, state="serving")], True),  # it moved to another stage: its round here ended
        ([StageCallError(ErrorCode.BAD_REQUEST, "odd", MATE)], False),
    ],
    ids=["serving", "refused", "silent-once", "silent-answer-silent", "silent-twice", "moved", "other-error"],
)
def test_a_probed_member_is_dropped_only_on_a_sign_of_death_or_of_a_move(monkeypatch, answers, dropped):
    members, gone = probe_with(monkeypatch, answers)
    assert (members == [MATE] and gone == {MATE}) if dropped else (not members and not gone)
