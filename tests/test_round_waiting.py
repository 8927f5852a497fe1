"""How a round decides a member it waits for is gone, from what a probe of it gives back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from swarm.net.transport import StageCallError
from swarm.peer import mates as mates_module
from swarm.peer import round_waiting, step_machine
from swarm.peer.mates import StageMates
from swarm.peer.round_waiting import SILENT_PROBES, RoundWaiting
from swarm.peer.step_machine import SEND_ATTEMPTS, StepMachine
from swarm.proto import ErrorCode, PeerInfo

MATE = "QmPeerMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMM"


class Membership:
    def __init__(self) -> None:
        self.dropped: list[str] = []
        self.mates: dict[str, None] = {}

    def mark_unreachable(self, peer_id: str) -> None:
        self.dropped.append(peer_id)


def probe_with(
    monkeypatch, answers: list, resyncs: list | None = None, nudged: list | None = None
) -> tuple[list[str], set[str]]:
    """Probes MATE once per answer (a PeerInfo, or a StageCallError raised): the members dropped, and `gone`;
    the resyncs asked for and the members nudged go into `resyncs` and `nudged`."""
    replies = iter(answers)
    resyncs = [] if resyncs is None else resyncs
    nudged = [] if nudged is None else nudged

    async def get_peer_info(p2p, peer_id, timeout):  # the probe's one call, answered as the case needs
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    monkeypatch.setattr(round_waiting, "get_peer_info", get_peer_info)

    async def go() -> tuple[list[str], set[str]]:
        machine = SimpleNamespace(
            stage=1, p2p=None, changed=asyncio.Event(), resyncs=[], runtime=SimpleNamespace(step=5)
        )
        machine.schedule_resync = machine.resyncs.append
        # a member past the round stepped on it without this peer: the machine ends the round and resyncs
        machine.mate_stepped_past = lambda step, mate, at: machine.resyncs.append(f"{mate} stepped {step}, at {at}")
        membership = Membership()
        waiting = RoundWaiting(machine, membership, 30.0)
        gone: set[str] = set()
        for _ in answers:
            await waiting._probe(5, MATE, gone, nudged.append)
        resyncs.extend(machine.resyncs)
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


@pytest.mark.parametrize(
    ("answers", "serves"),
    [
        ([PeerInfo(stage=1, state="serving")], True),
        ([REFUSED, PeerInfo(stage=1, state="serving")], True),
        ([REFUSED, SILENT], False),  # every record is a dead peer's last word: the stage has no other live peer
        ([PeerInfo(stage=2, state="serving")], False),  # it moved
        ([PeerInfo(stage=1, state="leaving")], False),
        ([], False),
    ],
    ids=["serving", "one-of-two-dead", "all-dead", "moved", "leaving", "alone"],
)
def test_a_peer_moves_off_its_stage_only_if_another_peer_answers_that_it_serves_it(monkeypatch, answers, serves):
    replies = iter(answers)

    async def get_peer_info(p2p, peer_id, timeout):
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    monkeypatch.setattr(mates_module, "get_peer_info", get_peer_info)
    stage_mates = StageMates.__new__(StageMates)  # only the liveness question is exercised
    stage_mates.stage, stage_mates.machine = 1, SimpleNamespace(p2p=object())
    stage_mates.membership = SimpleNamespace(mates={"QmPeer" + "ABC"[i] * 40: None for i in range(len(answers))})
    assert asyncio.run(stage_mates.another_serves()) == serves


def test_a_probed_member_that_stepped_past_the_round_makes_this_peer_take_the_mates_state(monkeypatch):
    """It stepped on the round without this peer (their views of the members differed): nothing more comes for
    this round, and waiting for it would hold the mates' next round up for the whole timeout."""
    resyncs: list[str] = []
    members, gone = probe_with(monkeypatch, [PeerInfo(stage=1, step=6)], resyncs)
    assert not members and not gone and resyncs == [f"{MATE} stepped 5, at 6"]
    resyncs.clear()
    probe_with(monkeypatch, [PeerInfo(stage=1, step=5)], resyncs)
    assert not resyncs  # at the round's step: it is in the round too


def test_a_probed_member_alive_at_the_rounds_step_is_sent_this_peers_offer_again(monkeypatch):
    """Traced in a wave run: three peers joined a stage while its round was under way, and the round stood still
    for 13 s with every member alive, each waiting for another, until a wave killed one. A member that answers
    from the round's step is reminded with this peer's offer, which starts or unblocks its side of the round."""
    nudged: list[str] = []
    members, gone = probe_with(monkeypatch, [PeerInfo(stage=1, step=5)], nudged=nudged)
    assert nudged == [MATE] and not members and not gone
    nudged.clear()
    probe_with(monkeypatch, [PeerInfo(stage=1, step=6), PeerInfo(stage=2, step=5), SILENT], nudged=nudged)
    assert not nudged  # past the round, on another stage, or silent: no reminder


@pytest.mark.parametrize(
    ("failure", "tries"),
    [
        (ControlFailure("Connect failed. msg=failed to dial: failed to dial Qm: all dials failed: dial backoff"), 1),
        (ConnectionResetError("Connection reset by peer"), SEND_ATTEMPTS),
        (asyncio.TimeoutError(), SEND_ATTEMPTS),
    ],
    ids=["dial_refused", "reset", "timeout"],
)
def test_a_call_to_a_mate_is_tried_again_unless_its_dial_was_refused(monkeypatch, failure, tries):
    """A refused dial means nothing listens at the mate's addresses (libp2p answers the next dial within its
    backoff alike): the round learns it at once. A broken or slow call may go through the next time."""
    calls = []

    async def exchange(p2p, peer_id, protocol, frames, reply_type, limits):
        calls.append(peer_id)
        raise failure

    async def no_sleep(seconds):
        pass

    monkeypatch.setattr(step_machine, "exchange", exchange)
    monkeypatch.setattr(step_machine.asyncio, "sleep", no_sleep)
    reply = asyncio.run(StepMachine.call_mate(SimpleNamespace(p2p=None), MATE, "/swarm/mates/slice", [], 5.0))
    assert reply is failure and len(calls) == tries


def waiting_at(clock: list[float], p2p: object = None) -> tuple[RoundWaiting, list, Membership]:
    """A RoundWaiting on a clock the test moves; the probes it would start are listed, not run."""
    spawned: list = []

    def spawn(coroutine) -> None:
        spawned.append(coroutine)
        coroutine.close()  # only that it was started matters here

    machine = SimpleNamespace(
        stage=1,
        p2p=p2p,
        changed=asyncio.Event(),
        loop=SimpleNamespace(time=lambda: clock[0]),
        spawn=spawn,
        receipts=None,
    )
    membership = Membership()
    membership.mates[MATE] = None
    return RoundWaiting(machine, membership, 30.0), spawned, membership


def test_a_missing_member_is_first_probed_soon_then_every_probe_period():
    """A mate killed mid-round held its stage's round for PROBE_EVERY (2 s, traced) before the first probe said
    it was gone; a probe is one small call, so the first comes FIRST_PROBE seconds after the member was missed."""
    clock = [100.0]
    waiting, spawned, _ = waiting_at(clock)
    probed: dict[str, float] = {}
    waiting.probe_late(5, {MATE}, probed, set())
    assert not spawned  # just found missing: it may be a moment late
    clock[0] += round_waiting.FIRST_PROBE
    waiting.probe_late(5, {MATE}, probed, set())
    assert len(spawned) == 1
    clock[0] += round_waiting.PROBE_EVERY - 0.01
    waiting.probe_late(5, {MATE}, probed, set())
    assert len(spawned) == 1
    clock[0] += 0.01
    waiting.probe_late(5, {MATE}, probed, set())
    assert len(spawned) == 2
    assert waiting.wait_for({MATE}, clock[0]) <= round_waiting.FIRST_PROBE  # the phase looks again in time


def test_a_member_whose_address_refused_a_call_since_it_answered_is_dropped_without_a_probe():
    """Another call of this peer (a copy's refresh, a progress message) found the mate's port closed where it had
    answered: the round drops it at once rather than wait to find it out by a probe of its own."""
    clock = [100.0]
    plane = SimpleNamespace(refused_since_answered=lambda peer_id: peer_id == MATE)
    waiting, spawned, membership = waiting_at(clock, plane)
    gone: set[str] = set()
    other = "QmPeerOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOO"
    waiting.probe_late(5, {MATE, other}, {}, gone)
    assert gone == {MATE} and membership.dropped == [MATE] and not spawned
    assert waiting.machine.changed.is_set()  # the waiting phase is woken to go on without it
