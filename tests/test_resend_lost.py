"""A trainer sending again the microbatches a SHORT reply (or a short peer's record) names as lost: once per step
where a live peer took it."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from swarm.proto import SampleId, StageReply
from swarm.records.stage_records import MAX_SHORT, SERVING, StageRecord
from swarm.trainer.stage_calls import StageCaller

TRAINER = "QmTrainerTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT"
PEER_A = "QmPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
PEER_C = "QmPeerCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"


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


def test_a_short_reply_says_whether_this_trainer_sent_again_all_it_named():
    """The call that met SHORT asks again at once only where its trainer sent again everything the reply named:
    the peer then holds the call until its step. Where others' samples, or ours not held, are missing, it waits."""
    router = Peers("A")
    caller, sent = caller_with(router)
    assert asyncio.run(caller.resend_lost(2, short(5), to="A")) is True
    assert sent == [(7, 5, "A")]
    theirs = short(6)
    theirs.lost.append(SampleId(trainer="QmOtherTrainerOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOO", microbatch=8, samples=4))
    assert asyncio.run(caller.resend_lost(2, theirs, to="A")) is False, "another trainer's samples are missing"
    assert sent[-1] == (7, 6, "A"), "ours went again all the same"
    gone = StageReply(short_step=7)
    gone.lost.append(SampleId(trainer=TRAINER, microbatch=99, samples=4))  # not in the resend buffer any more
    assert asyncio.run(caller.resend_lost(2, gone, to="A")) is False
    assert asyncio.run(caller.resend_lost(2, StageReply(short_step=8), to="A")) is False, "names nothing"


def short_record(peer: str, step: int, short: tuple) -> StageRecord:
    return StageRecord(peer, 2, "gpt-tiny", 3, SERVING, step, 10.0, 0, 24, 0, 1, short_step=step, short=short)


def test_a_short_peers_record_has_the_trainer_send_its_lost_microbatches_again_once_per_step():
    """A trainer whose calls wait at another stage never hears a short stage's SHORT reply: the peer's record names
    what it waits for, and the trainer sends its own again, once per short step."""
    router = Peers(PEER_A, PEER_C)
    caller, sent = caller_with(router)
    other = "QmOtherTrainerOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOO"
    record = short_record(PEER_A, 5, ((TRAINER, 7, 4), (other, 8, 4)))
    asyncio.run(caller.resend_listed(2, record))
    assert sent == [(7, 5, PEER_A)], "only its own microbatch, to the peer that is short of it"
    asyncio.run(caller.resend_listed(2, record))  # the next read of the same record
    asyncio.run(caller.resend_listed(2, short_record(PEER_C, 5, ((TRAINER, 7, 4),))))
    assert len(sent) == 1, "sent again for step 5 already"
    asyncio.run(caller.resend_listed(2, short_record(PEER_A, 6, ((TRAINER, 7, 4),))))
    assert sent[-1] == (7, 6, PEER_A), "a later step short of it: again"


@pytest.mark.parametrize(
    "short, step",
    [
        (((TRAINER, 7, 4),), -1),  # lost microbatches without the step they were lost at
        ((("not a peer id", 7, 4),), 5),
        (((TRAINER, -1, 4),), 5),
        (((TRAINER, 7, 0),), 5),
        (((TRAINER, 7),), 5),
        (tuple((TRAINER, mb, 4) for mb in range(MAX_SHORT + 1)), 5),
    ],
)
def test_a_record_whose_lost_microbatches_are_malformed_is_dropped(short, step):
    record = short_record(PEER_A, 5, ((TRAINER, 7, 4),))
    assert StageRecord.from_value(record.to_value(), 99.0) == dataclasses.replace(record, expiration=99.0)
    value = {**record.to_value(), "short": [list(entry) for entry in short], "short_step": step}
    assert StageRecord.from_value(value, 99.0) is None
    old = {k: v for k, v in record.to_value().items() if k not in ("short", "short_step")}  # a peer before them
    assert StageRecord.from_value(old, 99.0).short == ()
