"""A trainer sending again the microbatches a SHORT reply names as lost: once per step where a live peer took it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from swarm.proto import SampleId, StageReply
from swarm.trainer.stage_calls import StageCaller

TRAINER = "QmTrainerTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT"


class Peers:
    """The router's view of a stage's live peers."""

    def __init__(self, *live: str) -> None:
        self.live = list(live)

    def live_peers(self, stage: int) -> list:
        return [SimpleNamespace(peer_id=p) for p in self.live]


def caller_with(router: Peers) -> tuple[StageCaller, list]:
    config = SimpleNamespace(resend_buffer_mb=1, voucher=None)
    summary = SimpleNamespace(samples_resent=0, lost_not_held=0)
    caller = StageCaller(config, None, TRAINER, router, None, summary, None, None)
    sent: list = []

    async def call(stage, backward, tensors, microbatch_id, step, prefer=None):
        sent.append((microbatch_id, step, prefer))
        caller.served_by = prefer if prefer in router.live else router.live[0]  # the router's choice
        return StageReply(step=step), []

    caller.call = call
    caller._resend_buffer.put((2, 7), [torch.zeros(4, 3)])
    return caller, sent


def short(step: int) -> StageReply:
    reply = StageReply(short_step=step)
    reply.lost.append(SampleId(trainer=TRAINER, microbatch=7, samples=4))
    return reply


def test_a_microbatch_two_peers_report_lost_at_one_step_goes_again_once_while_its_taker_lives():
    # two peers answer SHORT naming it: the one left out of the round (accused meanwhile, or cut off) has not
    # heard that the other took it again, and a second copy would be counted twice
    router = Peers("A", "C")
    caller, sent = caller_with(router)
    asyncio.run(caller.resend_lost(2, short(5), to="A"))
    asyncio.run(caller.resend_lost(2, short(5), to="B"))
    assert sent == [(7, 5, "A")]
    # the taker died before its round: the next SHORT sends it again
    router.live = ["C"]
    asyncio.run(caller.resend_lost(2, short(5), to="C"))
    assert sent == [(7, 5, "A"), (7, 5, "C")]
    # its taker lost it itself (it dropped it to take a state), or a later step is short of it: again
    asyncio.run(caller.resend_lost(2, short(5), to="C"))
    asyncio.run(caller.resend_lost(2, short(6), to="A"))
    assert sent == [(7, 5, "A"), (7, 5, "C"), (7, 5, "C"), (7, 6, "A")]
