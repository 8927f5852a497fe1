"""A newcomer that asks a mate for the stage's state while the mate's round is under way is given the state after
that round, and so takes part in the next one: given the state from before it, it was out of the round, and its
first requests waited for a step it would not take until it found its mates past it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from test_progress_delivery import two_peers, until

import swarm.peer.state_handover as state_handover
from swarm.peer.state_handover import StateHandOver
from swarm.peer.step_machine import AVERAGING
from swarm.proto import PROTOCOL_VERSION, StateReply, StateRequest


async def ask_during_a_round(round_ends: bool) -> tuple[int, bool]:
    """A newcomer's state request to a stage-1 peer whose round of step 0 is under way (and ends, if asked, once
    the request is in): the step of the state given, and whether the answer waited for the round."""
    async with two_peers() as (machine, membership, progress, newcomer_p2p):
        newcomer = str(newcomer_p2p.peer_id)
        averaging = SimpleNamespace(departed=set())
        averaging.depart = averaging.departed.add
        handover = StateHandOver(machine, membership, progress, averaging)
        runtime = machine.runtime
        runtime.start()
        try:
            machine.steps[0].phase = AVERAGING
            request = StateRequest(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1)
            answer = asyncio.ensure_future(handover._answer(newcomer, request, [], StateReply()))
            await until(lambda: newcomer in averaging.departed)  # the round stops waiting for it
            waited = not answer.done()
            if round_ends:
                runtime.step = 1  # the round stepped
            frames = await answer
            return frames[0].message.step, waited
        finally:
            runtime.shutdown(timeout=10)


@pytest.mark.timeout(60)
def test_a_newcomer_asking_during_a_round_is_given_the_state_after_it():
    assert asyncio.run(ask_during_a_round(round_ends=True)) == (1, True)


@pytest.mark.timeout(60)
def test_a_round_that_does_not_end_soon_holds_the_newcomer_only_so_long(monkeypatch):
    monkeypatch.setattr(state_handover, "ROUND_END_WAIT", 0.3)
    assert asyncio.run(ask_during_a_round(round_ends=False)) == (0, True)
