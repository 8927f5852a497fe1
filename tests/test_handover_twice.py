"""A leaver's hand-over and its trainers' retries of the same microbatches never both count. A p3 replay: a peer
of stage 2 stopped answering its round to move to a lost stage; its mates counted it dead holding 4 microbatches
and asked for them again; its hand-over of those 4 came 5 ms later; the retries were summed too, and 32 samples
counted twice."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch
from test_round_left_behind import MATE, ME, averaging_round, hand_over_to

from swarm.peer.step_machine import SHORT, Contribution, handed_twice
from swarm.proto import ErrorCode

OTHER = "QmPeerOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOO"


def held(*microbatches: int) -> dict:
    return {("t", mb): 8 for mb in microbatches}


def offer(microbatches: tuple[int, ...], handover: bool = False) -> Contribution:
    ids = held(*microbatches)
    return Contribution(8 * len(ids), torch.ones(6), frozenset({ME, MATE}), ids, dict(ids), handover=handover)


def test_only_hand_overs_naming_a_microbatch_another_agreed_contribution_holds_are_found():
    box = {ME: offer((1, 2)), MATE: offer((2, 3), handover=True), OTHER: offer((4,), handover=True)}
    assert handed_twice(box, {ME, MATE, OTHER}) == [MATE]
    assert handed_twice(box, {MATE, OTHER}) == []  # what no agreed contribution holds is no double
    assert handed_twice({ME: offer((1,)), MATE: offer((1,))}, {ME, MATE}) == []  # two offers: the bound's concern


def test_a_hand_over_after_the_retries_were_summed_is_left_out_and_what_only_it_held_is_asked_for_again():
    async def go():
        averaging, _ = averaging_round()
        state = averaging.machine.steps[5]
        state.progress[MATE] = held(2, 3)
        state.mailbox[0][MATE] = offer((2, 3), handover=True)  # came after this peer summed the retry of 2
        result = await asyncio.wait_for(averaging.round(5, torch.ones(6), held(1, 2)), 10)
        return result, state

    result, state = asyncio.run(go())
    assert result is None and state.phase == SHORT
    assert state.lost == held(3), "what only the hand-over held is lost, and asked for again"
    assert MATE not in state.progress, "it holds nothing that counts: retries of its microbatches must be summed"


def test_a_hand_over_before_the_retries_makes_them_answered_without_summing():
    async def go():
        averaging, _ = averaging_round()
        noted: list[int] = []
        averaging.progress = SimpleNamespace(note_holdings=lambda: noted.append(1))
        error = await hand_over_to(averaging, held(2, 3))
        return error, averaging.machine.steps[5], noted

    error, state, noted = asyncio.run(go())
    assert error.code == ErrorCode.OK
    assert state.progress[MATE] == held(2, 3) and noted, "its microbatches count as held by a member"
    assert state.known().keys() >= held(2, 3).keys(), "a round short of them finds them held again"


def test_an_empty_hand_over_takes_back_what_its_sender_said_it_held():
    """A peer that moved mid-round hands over nothing (its gradients were in the round it left); what its progress
    had named is held by no one now. A chaos replay: that claim ended the short round at once, round after round
    for 20 s, and the trainers were never asked for the 4 microbatches."""

    async def go():
        averaging, _ = averaging_round()
        state = averaging.machine.steps[5]
        state.progress[MATE] = held(2, 3)
        error = await hand_over_to(averaging, {})
        return error, state

    error, state = asyncio.run(go())
    assert error.code == ErrorCode.OK and state.mailbox[0][MATE].handover
    assert not state.progress[MATE] and not state.known(), "what it said it held is no one's now"


def test_a_short_round_asks_again_for_what_a_member_claimed_but_the_round_did_not_sum():
    async def go():
        averaging, _ = averaging_round()
        state = averaging.machine.steps[5]
        state.progress[MATE] = held(2, 3)  # a stale claim: its hand-over, agreed, holds nothing
        state.mailbox[0][MATE] = Contribution(0, None, frozenset({ME, MATE}), {}, held(2, 3), handover=True)
        result = await asyncio.wait_for(averaging.round(5, torch.ones(6), held(1)), 10)
        return result, state, averaging.machine

    result, state, machine = asyncio.run(go())
    assert result is None and state.phase == SHORT and state.lost == held(2, 3)
    assert not state.known().keys() & held(2, 3).keys(), "a claim the agreed round contradicts is dropped"
    assert machine.lost() == held(2, 3), "the trainers are asked for them (a SHORT reply names them)"
