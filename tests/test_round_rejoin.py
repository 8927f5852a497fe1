"""A member that falls behind a round under way (it is taking a state) and catches up is not waited for until the
averaging timeout: what it refused from behind is sent again, and what it cannot take part in any more ends the
wait at once. A wave run: a stage left with one peer, three newcomers joining at once, one of them refusing the
round's messages while it loaded, and the round standing in its slices for 17 s."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace

import torch
from test_round_left_behind import MATE, ME, PROGRESS, Membership, stage_1_at_step_5

from swarm.compression import get_codec
from swarm.net.wire import WireLimits
from swarm.peer.averaging_round import AveragingRound
from swarm.peer.mate_messages import ids_to_wire
from swarm.peer.slice_exchange import RESEND_PAUSE, SliceExchange
from swarm.peer.state_handover import attempt_to_join
from swarm.peer.step_machine import ACCUMULATING, AVERAGING, Contribution, StepState
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, GradContribution, MateReply, RoundSlice, SliceKind

NEWCOMER = "QmPeerNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNN"


def behind(step: int) -> MateReply:
    """A mate's refusal from an earlier step: it is still taking a state."""
    return MateReply(step=step, error=Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at step {step}"))


class Mates(Membership):
    """`Membership`, with no accusations."""

    accused: dict = {}


def slices_at_step_5(replies: list[MateReply], timeout: float = 5.0) -> tuple[SliceExchange, list[str]]:
    """A peer's slice exchange at step 5, attempt 0, whose mate answers each send with the next of `replies`
    (the last one again once they run out); returns it and the peers its sends went to, in order."""
    loop = asyncio.get_running_loop()
    calls: list[str] = []

    async def call_mate(peer_id, protocol, frames, timeout, limits=None):
        calls.append(peer_id)
        return replies[min(len(calls), len(replies)) - 1]

    machine = SimpleNamespace(
        model="gpt-tiny",
        stage=1,
        peer_id=ME,
        loop=loop,
        changed=asyncio.Event(),
        limits=WireLimits(),
        runtime=SimpleNamespace(step=5),
        steps=defaultdict(StepState),
        call_mate=call_mate,
        check_left_behind=lambda step: None,
    )
    machine.steps[5].phase = AVERAGING  # this peer's round at step 5, attempt 0, is under way
    waiting = SimpleNamespace(probe_late=lambda *args: None, wait_for=lambda missing, started: 10.0)
    return SliceExchange(machine, Mates(), get_codec("none"), timeout, waiting), calls


def part(attempt: int = 0) -> RoundSlice:
    return RoundSlice(step=5, attempt=attempt, count=2, index=1, kind=SliceKind.PART)


def test_a_slice_refused_from_behind_the_round_goes_again_until_the_mate_takes_it():
    async def go() -> tuple[list[str], set[str]]:
        exchange, calls = slices_at_step_5([behind(3), behind(5), MateReply(step=5)])
        await exchange._send(MATE, part(), torch.ones(3))
        return calls, exchange.unsent.get((5, 0), set())

    calls, unsent = asyncio.run(asyncio.wait_for(go(), 10))
    assert calls == [MATE] * 3 and unsent == set()


def test_a_slice_goes_again_only_while_this_peers_attempt_stands():
    async def go() -> tuple[list[str], set[str]]:
        exchange, calls = slices_at_step_5([behind(3)])
        sending = asyncio.create_task(exchange._send(MATE, part(), torch.ones(3)))
        await asyncio.sleep(RESEND_PAUSE * 2.5)
        exchange.machine.steps[5].attempt = 1  # this peer gave the attempt up
        await asyncio.wait_for(sending, RESEND_PAUSE * 4)
        return calls, exchange.unsent.get((5, 0), set())

    calls, unsent = asyncio.run(asyncio.wait_for(go(), 10))
    assert 2 <= len(calls) <= 4 and unsent == {MATE}


def test_a_mate_that_refuses_a_slice_ends_the_wait_for_its_own_at_once():
    """A mate that moved to restore another stage refuses this stage's slices (no record puts this peer on its
    stage now): the round waited 3.4 s for its sum in a replay, then failed anyway."""

    async def go() -> tuple[bool | None, float, list[str]]:
        forbidden = MateReply(step=5, error=Error(code=ErrorCode.FORBIDDEN, message="no signed record puts it"))
        exchange, calls = slices_at_step_5([forbidden], timeout=30.0)
        await exchange._send(MATE, part(), torch.ones(3))
        loop = asyncio.get_running_loop()
        started = loop.time()
        verdict = await exchange._wait(5, 0, exchange.machine.steps[5], lambda: None, lambda: {MATE})
        return verdict, loop.time() - started, calls

    verdict, waited, calls = asyncio.run(asyncio.wait_for(go(), 10))
    assert verdict is False and waited < 1.0 and calls == [MATE]


def test_an_offer_refused_from_behind_goes_again_once_the_member_sends_its_own():
    """The member still loaded a state when this peer offered; once it has, it offers in turn and waits for this
    peer's offer, which this peer's probes would send it again only seconds later."""

    async def go() -> tuple[bool, list[str]]:
        machine = stage_1_at_step_5()
        machine.serving = True
        machine.start(p2p=None)
        averaging = AveragingRound(machine, Mates(), None, 30.0, 20.0, get_codec("none"))
        calls: list[str] = []

        async def call_mate(peer_id, protocol, frames, timeout, limits=None):
            calls.append(peer_id)
            return behind(3) if peer_id == MATE and calls.count(MATE) == 1 else MateReply(step=5)

        machine.call_mate = call_mate
        state = machine.steps[5]
        own = Contribution(8, torch.zeros(6), frozenset({ME, MATE}), {("t", 1): 8}, {("t", 1): 8})
        state.mailbox[0][ME] = own

        def offer(peer_id: str, microbatch: int) -> None:
            held = {("t", microbatch): 8}
            state.mailbox[0][peer_id] = Contribution(8, None, frozenset({ME, MATE, NEWCOMER}), held, dict(held))
            machine.changed.set()

        gathering = asyncio.create_task(averaging._gather(5, 0, state, {ME, MATE, NEWCOMER}, own))
        while len(calls) < 2:  # the round still waits for the newcomer's offer
            await asyncio.sleep(0.01)
        offer(MATE, 2)  # it took its state, and offers in turn
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        offer(NEWCOMER, 3)
        return await asyncio.wait_for(gathering, 5), calls

    done, calls = asyncio.run(asyncio.wait_for(go(), 10))
    assert done and sorted(calls) == sorted([MATE, NEWCOMER, MATE])


def test_a_member_whose_offer_is_in_the_round_under_way_takes_a_state_into_the_next_attempt():
    state = StepState(phase=AVERAGING, attempt=2)
    state.mailbox[2][NEWCOMER] = Contribution(0, None, frozenset({ME, NEWCOMER}))
    assert attempt_to_join(state, NEWCOMER, member=True) == 3
    assert attempt_to_join(state, MATE, member=True) == 2  # no offer in it: it joins the one under way
    assert attempt_to_join(state, NEWCOMER, member=False) == 2  # a standby holder takes no part in rounds
    assert attempt_to_join(StepState(phase=ACCUMULATING, attempt=2), NEWCOMER, member=True) == 2


def test_an_offer_that_comes_again_or_after_the_gather_is_answered_with_this_peers_offer_once():
    """A wave run: a newcomer refused a mate's offer 21 ms before it loaded its state, then offered in turn; the
    mate had gathered without it and never sent its offer again, so the newcomer waited for it, and the stage's
    round, which counted the newcomer in, waited for its commit until the averaging timeout (17 s)."""

    async def go() -> list[tuple[str, int]]:
        machine = stage_1_at_step_5()
        machine.serving = True
        machine.start(p2p=None)
        averaging = AveragingRound(machine, Mates(), PROGRESS, 30.0, 20.0, get_codec("none"))
        sent: list[tuple[str, int]] = []

        async def send(peer_id, step, own, members, unreachable, handover=False, attempt=0) -> None:
            sent.append((peer_id, attempt))

        averaging._send_contribution = send
        state = machine.steps[5]
        state.phase = AVERAGING
        for attempt in (0, 1):
            state.mailbox[attempt][ME] = Contribution(8, torch.zeros(6), frozenset({ME, MATE}), {("t", 1): 8})

        def offer(peer_id: str, attempt: int) -> GradContribution:
            held = ids_to_wire({("t", 2): 8})
            members = sorted({ME, peer_id})
            header = GradContribution(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=5)
            header.samples, header.attempt = 8, attempt
            header.members.extend(members)
            header.held.extend(held)
            return header

        averaging.answers.gather_ended(5, 0)
        for _ in range(2):  # after the gather: answered, once
            assert (await averaging._accept_contribution(NEWCOMER, offer(NEWCOMER, 0), [])).code == ErrorCode.OK
        state.attempt = 1  # the gather of attempt 1 under way: a first offer is no sign, one that comes again is
        await averaging._accept_contribution(MATE, offer(MATE, 1), [])
        await averaging._accept_contribution(MATE, offer(MATE, 1), [])
        for _ in range(3):
            await asyncio.sleep(0)
        return sent

    assert asyncio.run(asyncio.wait_for(go(), 10)) == [(NEWCOMER, 0), (MATE, 1)]
