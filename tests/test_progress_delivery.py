"""A backward is answered once every live mate knows this peer holds it: should the peer then die, a survivor
names the loss and its trainer sends it again. Two mates this could miss: a newcomer that took the state and
did not answer a moment, and a mate that went silent once (a loaded host) and spoke again. One it must not wait
for: a mate that handed over and left for another stage, where its gate refuses a message only after a read."""

from __future__ import annotations

import asyncio
import contextlib

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.net.transport import PROGRESS_PROTOCOL
from swarm.peer.faults import FaultPlan
from swarm.peer.mate_membership import NEWCOMER_GRACE, MateMembership
from swarm.peer.mate_progress import ProgressExchange
from swarm.peer.protocol_handler import send_reply
from swarm.peer.runtime import StageRuntime
from swarm.peer.step_machine import StepMachine
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, MateReply
from swarm.records.stage_records import SERVING, StageRecord

TRAINER = "12D3KooW" + "T" * 44


def stage_1_peer(peer_id: str, serving: bool) -> tuple[StepMachine, MateMembership, ProgressExchange]:
    """A peer of stage 1 of 3 of gpt-tiny at step 0: its step machine, membership and progress exchange."""
    module = build_stage(get_model_spec("gpt-tiny"), 1, 3, seed=0)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=16)
    machine = StepMachine(runtime, peer_id, "gpt-tiny", FaultPlan())
    machine.serving = serving
    membership = MateMembership(machine)
    return machine, membership, ProgressExchange(machine, membership)


@contextlib.asynccontextmanager
async def two_peers():
    """Two stage-1 peers over real libp2p: the first's machine, membership and progress exchange (its machine
    started on its P2P), and the second's P2P, which answers no mate protocol yet."""
    first_p2p = await P2P.create()
    second_p2p = await P2P.create(initial_peers=[str(a) for a in await first_p2p.get_visible_maddrs()])
    try:
        machine, membership, progress = stage_1_peer(str(first_p2p.peer_id), serving=True)
        machine.start(first_p2p)
        yield machine, membership, progress, second_p2p
    finally:
        await second_p2p.shutdown()
        await first_p2p.shutdown()


async def until(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_newcomer_that_missed_a_progress_message_hears_the_next_one_toward_a_later_step():
    async def go() -> dict:
        async with two_peers() as (machine, membership, progress, newcomer_p2p):
            giver_id, newcomer_id = machine.peer_id, str(newcomer_p2p.peer_id)
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

    assert asyncio.run(asyncio.wait_for(go(), 90)) == {(TRAINER, 1): 2, (TRAINER, 2): 2}


def test_a_mate_that_went_silent_and_spoke_again_is_waited_for_before_a_backward_is_answered():
    # a mate that missed one progress message is likely dead, and is not waited for; once it speaks again it is
    # alive, and a backward answered without its hearing would, should this peer die with the rest of a wave,
    # be known to no survivor
    async def go() -> tuple[dict, float]:
        async with two_peers() as (machine, _, progress, mate_p2p):
            peer_id, mate_id = machine.peer_id, str(mate_p2p.peer_id)
            await machine.p2p.add_binary_stream_handler(PROGRESS_PROTOCOL, progress.handle)
            machine.steps[0].progress.setdefault(mate_id, {})
            progress.on_local_progress(0, {(TRAINER, 1): 2})  # the mate takes no progress yet: it goes silent
            await until(lambda: progress._silent)
            mate, _, mate_progress = stage_1_peer(mate_id, serving=True)
            mate.start(mate_p2p)

            async def slow(*args) -> None:  # a loaded host: each message is taken a second late
                await asyncio.sleep(1.0)
                await mate_progress.handle(*args)

            await mate_p2p.add_binary_stream_handler(PROGRESS_PROTOCOL, slow)
            mate.steps[0].progress.setdefault(peer_id, {})
            mate_progress.on_local_progress(0, {(TRAINER, 7): 2})  # it speaks
            await until(lambda: mate_id in machine.steps[0].progress and machine.steps[0].progress[mate_id])
            started = asyncio.get_running_loop().time()
            progress.on_local_progress(0, {(TRAINER, 1): 2, (TRAINER, 2): 2})
            await progress.delivered()  # as before a backward's reply
            waited = asyncio.get_running_loop().time() - started
            return dict(mate.steps[0].progress.get(peer_id, {})), waited

    heard, waited = asyncio.run(asyncio.wait_for(go(), 90))
    assert heard == {(TRAINER, 1): 2, (TRAINER, 2): 2}, f"answered after {waited:.2f}s, the mate not told"


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


def test_a_mate_that_handed_over_and_left_is_neither_told_nor_waited_for():
    # traced in a local swarm: a stage-1 peer left to restore a lost stage 2; its old mate kept telling it its
    # progress, which its new stage's gate refused only after re-reading the records, and every backward on the
    # old stage waited for that (1.07 s each), the trainers with them
    async def go() -> tuple[float, float, set[str]]:
        async with two_peers() as (machine, membership, progress, mover_p2p):
            mover_id = str(mover_p2p.peer_id)
            expiration = get_dht_time() + 60
            mover = StageRecord(mover_id, 1, "gpt-tiny", 3, SERVING, 0, 10.0, 0, 16, 0, PROTOCOL_VERSION, expiration)
            membership.take_records([mover])

            async def refused_after_a_read(stream_info, reader, writer) -> None:  # its new stage's gate
                await asyncio.sleep(1.0)
                error = Error(code=ErrorCode.FORBIDDEN, message="no signed record puts it on stage 2")
                await send_reply(reader, writer, [MateReply(protocol_version=PROTOCOL_VERSION, error=error)], "a mate")

            await mover_p2p.add_binary_stream_handler(PROGRESS_PROTOCOL, refused_after_a_read)
            loop = asyncio.get_running_loop()
            started = loop.time()
            progress.on_local_progress(0, {(TRAINER, 1): 2})  # a mate still: told, and waited for
            await progress.delivered()
            as_mate = loop.time() - started
            machine.steps[0].progress.setdefault(mover_id, {(TRAINER, 3): 2})  # what it held before it handed over
            membership.mark_left(mover_id)
            started = loop.time()
            progress.on_local_progress(0, {(TRAINER, 1): 2, (TRAINER, 2): 2})
            await progress.delivered()
            after_leaving = loop.time() - started
            return as_mate, after_leaving, set(progress._sends.values())

    as_mate, after_leaving, told_after = asyncio.run(asyncio.wait_for(go(), 90))
    assert as_mate >= 0.9, f"a mate is waited for ({as_mate:.2f}s)"
    assert after_leaving < 0.5 and not told_after, f"waited {after_leaving:.2f}s for a mover; told: {told_after}"
