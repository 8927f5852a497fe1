"""A peer that gave its state to a newcomer tells it its progress until the newcomer announces itself, even
through a moment the newcomer does not answer: otherwise the holdings it answered meanwhile are known to nobody
but itself, and should it die, they are lost without any peer naming them."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.net.transport import PROGRESS_PROTOCOL
from swarm.peer.faults import FaultPlan
from swarm.peer.mate_membership import NEWCOMER_GRACE, MateMembership
from swarm.peer.mate_progress import ProgressExchange
from swarm.peer.runtime import StageRuntime
from swarm.peer.step_machine import StepMachine

TRAINER = "12D3KooW" + "T" * 44


def stage_1_peer(peer_id: str, serving: bool) -> tuple[StepMachine, MateMembership, ProgressExchange]:
    """A peer of stage 1 of 3 of gpt-tiny at step 0: its step machine, membership and progress exchange."""
    module = build_stage(get_model_spec("gpt-tiny"), 1, 3, seed=0)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=16)
    machine = StepMachine(runtime, peer_id, "gpt-tiny", FaultPlan())
    machine.serving = serving
    membership = MateMembership(machine)
    return machine, membership, ProgressExchange(machine, membership)


async def until(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_newcomer_that_missed_a_progress_message_hears_the_next_one_toward_a_later_step():
    async def go() -> dict:
        giver_p2p = await P2P.create()
        newcomer_p2p = await P2P.create(initial_peers=[str(a) for a in await giver_p2p.get_visible_maddrs()])
        try:
            giver_id, newcomer_id = str(giver_p2p.peer_id), str(newcomer_p2p.peer_id)
            machine, membership, progress = stage_1_peer(giver_id, serving=True)
            machine.start(giver_p2p)
            # the newcomer took the state of step 0 (as `StateHandOver` records it); its round is under way, so
            # backwards accumulate toward step 1, where only the newcomer list says the newcomer is a member
            machine.steps[0].progress.setdefault(newcomer_id, {})
            membership.add_newcomer(newcomer_id)
            # the newcomer takes no progress yet (still loading the state): the first message fails
            progress.on_local_progress(1, {(TRAINER, 1): 2})
            await until(lambda: progress._silent)
            assert newcomer_id in membership.newcomers, "a newcomer is told on within its grace"
            # it answers from now on: the next message toward step 1 reaches it, with both microbatches
            newcomer, _, newcomer_progress = stage_1_peer(newcomer_id, serving=True)
            newcomer.start(newcomer_p2p)
            await newcomer_p2p.add_binary_stream_handler(PROGRESS_PROTOCOL, newcomer_progress.handle)
            progress.on_local_progress(1, {(TRAINER, 1): 2, (TRAINER, 2): 2})
            await until(lambda: giver_id in newcomer.steps[1].progress)
            await progress.delivered()
            return newcomer.steps[1].progress[giver_id]
        finally:
            await newcomer_p2p.shutdown()
            await giver_p2p.shutdown()

    assert asyncio.run(asyncio.wait_for(go(), 90)) == {(TRAINER, 1): 2, (TRAINER, 2): 2}


def test_a_newcomer_that_never_answers_is_dropped_after_its_grace():
    machine, membership, _ = stage_1_peer("12D3KooW" + "G" * 44, serving=True)
    newcomer = "12D3KooW" + "N" * 44

    class Clock:
        now = 100.0

        def time(self) -> float:
            return self.now

    machine.loop = Clock()
    membership.add_newcomer(newcomer)
    machine.loop.now += NEWCOMER_GRACE / 2
    membership.newcomer_silent(newcomer)
    assert newcomer in membership.newcomers
    machine.loop.now += NEWCOMER_GRACE
    membership.newcomer_silent(newcomer)
    assert newcomer not in membership.newcomers
    membership.newcomer_silent(newcomer)  # told of again after it was dropped: nothing to drop
    assert not membership.newcomers
