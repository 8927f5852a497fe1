"""What a mate holds toward the step after its round: backwards that come in while its round runs accumulate
there, and go back to the round's step when the round fails; once a retry sums them, no later step expects them."""

from __future__ import annotations

import asyncio

from test_progress_delivery import TRAINER, stage_1_peer

from swarm.proto import PROTOCOL_VERSION, ErrorCode, MateProgress, MateReply, SampleId

MATE = "12D3KooW" + "M" * 44


def tell(progress, step: int, *microbatches: int) -> None:
    """`MATE` tells this peer it holds `microbatches` (one sample each) toward `step`."""
    message = MateProgress(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=step)
    message.held.extend(SampleId(trainer=TRAINER, microbatch=m, samples=1) for m in microbatches)
    reply = MateReply()
    asyncio.run(progress._answer(MATE, message, [], reply))
    assert reply.error.code == ErrorCode.OK, reply.error.message


def test_what_a_failed_round_took_back_and_its_retry_summed_is_expected_at_no_later_step():
    # a CI run: a mate's round at step 0 failed short; the trainers' resends came in during its next attempt and
    # were told as held toward step 1, then went back to step 0, whose retry summed them. This peer kept the word
    # for step 1, its round there expected them, and stepped 2 of 24 samples short, counting them lost.
    machine, _, progress = stage_1_peer("12D3KooW" + "P" * 44, serving=True)
    tell(progress, 0, 1, 2)
    tell(progress, 1, 7, 8)  # the mate's round at step 0 runs: the resends accumulate toward step 1
    tell(progress, 1)  # the round failed: they go back to step 0 (a mate's holdings at a step never shrink)
    tell(progress, 0, 1, 2, 7, 8)
    tell(progress, 1, 9)  # a backward that truly came in toward step 1
    machine.runtime.step = 1  # the retry summed step 0 with the resends in it
    progress.reached(1)
    progress.remember_summed(frozenset((TRAINER, m) for m in (1, 2, 7, 8)))
    assert machine.steps[1].known() == {(TRAINER, 9): 1}
    tell(progress, 1, 7, 9)  # a stale word that arrives late is no holding either
    assert machine.steps[1].known() == {(TRAINER, 9): 1}
