"""Spot checks: a vouched trainer sends a small random share of its calls to a second peer of the stage.

Peers of a stage at the same step hold bit-identical parameters (their averaging rounds apply the same
sum), so the same inputs give the same outputs up to the nondeterminism of how a peer batches and which
kernels it runs. A check sends a forward already answered by peer A, with the same inputs, microbatch
and step, to another serving peer B, and compares the outputs within `tolerance`. Both replies come in the codec
A's did, and the tolerance widens by that codec's gap between levels (4bit's is too wide: such forwards
are not checked), and only answers computed at the same step are compared (a peer that moved on answers at its
own step). A backward is checked as a spot-check call (`StageRequest.check`): the second peer computes the
input gradients of the same inputs and output gradients at the same step and holds nothing, so no sample
counts twice. Gradients are compared relative to their own scale (no absolute floor: they are small), and
the first stage's backward, which answers no input gradient, is not checked (its gradient goes to the
rounds, which bound it).

When A and B disagree, nothing says which lied: a third serving peer C at that step decides, and the one
that disagrees with the two others is accused, once the three announce the same (step, fingerprint) (so
an honest replica whose state diverged, which the stage's resync repairs, is never taken for a liar).
With two peers only, or no two answers agreeing, no one is accused: the disagreement is logged and
counted. The accusation is signed with the trainer's vouched key (`swarm.records.accusations`),
published in the DHT, and taken in at once by this trainer's router, which calls the accused no more.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from hivemind import DHT
from hivemind.p2p import PeerID

from swarm.compression.codecs import Codec
from swarm.net.transport import CallStats, StageCallError, get_peer_info
from swarm.policy.router import Router
from swarm.proto import StageReply
from swarm.records.accusations import Accusation, AccusationBook, publish_accusations, sign_accusation
from swarm.records.stage_records import StageRecord
from swarm.trust.receipts import ReceiptSigner

logger = logging.getLogger(__name__)

# max|a - b| <= ATOL + RTOL * max|a|, per dtype of the replies. Same-step peers hold the same parameters:
# on a CPU a forward differs only by how the peer merged it with others' (float32: about 1e-6 of the
# largest value); GPU kernels of another card or batch shape move float32 by about 1e-5, half precision
# by a few units in its last place (bfloat16: 2**-8 = 4e-3). The bounds sit 10x and more above those,
# and far below a change anyone would make to steer training (scripts/harness/hostile_peer.py: 0.1).
RTOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
ATOL = 1e-4
# A reply in a lossy codec: two peers' outputs a hair apart may land one level apart, so the bound widens by the
# codec's largest gap between levels, relative to the largest value (measured over [-1, 1]: fp16 4.9e-4, bf16
# 3.9e-3, 8bit 1.4e-2), with room to spare. 4bit's gap (0.24) would hide any lie worth the name: not checked.
CODEC_GAP = {"none": 0.0, "fp16": 1e-3, "bf16": 8e-3, "8bit": 2e-2}
INFO_TIMEOUT = 5.0
RENEW_PERIOD = 60.0  # seconds between renewals of this trainer's accusations (their TTL is longer)
MAX_TASKS = 8  # checks under way at once: past this, a drawn check is skipped


def tolerance(reference: torch.Tensor, codec: str = "none", floor: float = ATOL) -> float:
    """How far another same-step peer's outputs may be from `reference` (max abs difference), both replies
    in `codec` (one of CODEC_GAP's); `floor` is the absolute part (0 for gradients)."""
    rtol = RTOL.get(reference.dtype, RTOL[torch.float16]) + CODEC_GAP[codec]
    return floor + rtol * float(reference.detach().abs().max()) if reference.numel() else floor


def outputs_agree(a: list[torch.Tensor], b: list[torch.Tensor], codec: str = "none", floor: float = ATOL) -> bool:
    """Whether two peers' outputs of the same call, both in `codec`, agree within `tolerance` (same shapes
    and dtypes first)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.numel() and float((x.float() - y.float()).abs().max()) > tolerance(x, codec, floor):
            return False
    return True


def digest(tensors: list[torch.Tensor]) -> str:
    """A short hash of outputs, named in an accusation."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def odd_one_out(
    answers: dict[str, list[torch.Tensor]], codec: str = "none", floor: float = ATOL
) -> tuple[str, list[str]] | None:
    """Of three or more answers, the one that disagrees with all others while those all agree with one
    another: (its peer, the others); None if the answers do not single out one peer."""
    peers = list(answers)
    for odd in peers:
        rest = [p for p in peers if p != odd]
        if len(rest) < 2 or any(outputs_agree(answers[odd], answers[p], codec, floor) for p in rest):
            continue
        if all(outputs_agree(answers[rest[0]], answers[p], codec, floor) for p in rest[1:]):
            return odd, rest
    return None


Send = Callable[..., Awaitable[tuple[StageReply, list[torch.Tensor]]]]


@dataclass(frozen=True)
class Call:
    """An answered call drawn for a check: what is asked again of other peers of its stage, at its step."""

    backward: bool
    tensors: list[torch.Tensor]
    microbatch_id: int
    step: int
    codec: Codec  # the replies' codec


@dataclass
class SpotCheckCounts:
    """What the spot checks did, for the summary."""

    drawn: int = 0  # calls drawn for a check
    backwards: int = 0  # of those, backwards
    compared: int = 0  # of those, compared with a second peer's answer at the same step
    mismatches: int = 0  # comparisons that disagreed
    undecided: int = 0  # disagreements that named no one (two peers only, or no two agreeing, or states differ)
    accusations: int = 0


class SpotChecker:
    """Draws forwards to check, checks them against other peers of the stage, and accuses the liars."""

    def __init__(
        self,
        share: float,
        send: Send,
        router: Router,
        signer: ReceiptSigner,
        book: AccusationBook,
        trainer_id: str,
        dht: DHT,
        seed: int | None = None,
    ) -> None:
        self.share = share
        self.send = send  # StageCaller.attempt: one attempt at a peer, its reply checked for shape and values
        self.router = router
        self.signer = signer
        self.book = book  # this trainer's view of the accused: its own accusations go in at once
        self.trainer_id = trainer_id
        self.dht = dht
        self.p2p = None  # set with the caller's: asks peers their (step, fingerprint)
        self.counts = SpotCheckCounts()
        self.mine: list[Accusation] = []
        self._random = random.Random(seed)
        self._tasks: set[asyncio.Task] = set()
        self._published = 0.0  # monotonic: when this trainer's accusations were last stored

    def after_call(
        self,
        record: StageRecord,
        backward: bool,
        tensors: list[torch.Tensor],
        microbatch_id: int,
        reply: StageReply,
        outputs,
        codec,
    ) -> None:
        """Called after each answered call: draws it for a check with probability `share` (a backward only where
        it answers input gradients)."""
        if self.mine and time.monotonic() - self._published > RENEW_PERIOD:
            self._spawn(self.publish())
        if backward and not outputs:
            return
        if self._random.random() >= self.share or codec.name not in CODEC_GAP or len(self._tasks) >= MAX_TASKS:
            return
        self.counts.drawn += 1
        self.counts.backwards += backward
        call = Call(backward, tensors, microbatch_id, reply.step, codec)
        self._spawn(self._check(record, call, list(outputs)))

    def _spawn(self, coroutine) -> None:
        async def guarded() -> None:  # a check that breaks is one check lost, never the trainer's business
            try:
                await coroutine
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning(f"A spot check failed: {type(e).__name__}: {e}")

        task = asyncio.ensure_future(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancels the checks under way."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _answer(self, record: StageRecord, call: Call):
        """`record`'s peer's answer to `call` at its step; None if it failed or answered at another step."""
        try:
            reply, outputs = await self.send(
                record,
                record.stage,
                call.backward,
                call.tensors,
                call.microbatch_id,
                call.step,
                call.codec.name,
                CallStats(),
                check=call.backward,
            )
        except StageCallError as e:
            logger.debug(f"Spot check of stage {record.stage}: {record.peer_id} did not answer: {e}")
            return None
        return outputs if reply.step == call.step else None

    async def _gather(self, answers: dict, others: list[StageRecord], count: int, call: Call) -> None:
        """Asks peers of `others` (taken from its end) until `answers` holds `count` answers at the step."""
        while others and len(answers) < count:
            record = others.pop()
            found = await self._answer(record, call)
            if found is not None:
                answers[record.peer_id] = found

    def _others(self, stage: int, exclude: set[str]) -> list[StageRecord]:
        others = [
            r for r in self.router.live_peers(stage) if r.peer_id not in exclude and r.peer_id not in self.book.accused
        ]
        self._random.shuffle(others)
        return others

    async def _check(self, first: StageRecord, call: Call, outputs) -> None:
        stage, step, microbatch_id = first.stage, call.step, call.microbatch_id
        answers = {first.peer_id: outputs}
        others = self._others(stage, {first.peer_id})
        await self._gather(answers, others, 2, call)
        if len(answers) < 2:
            return
        self.counts.compared += 1
        codec, floor = call.codec.name, 0.0 if call.backward else ATOL
        # off the event loop: a large model's boundary tensors take a while to compare
        if await asyncio.to_thread(outputs_agree, *answers.values(), codec, floor):
            return
        self.counts.mismatches += 1
        await self._gather(answers, others, 3, call)
        verdict = await asyncio.to_thread(odd_one_out, answers, codec, floor) if len(answers) >= 3 else None
        what = "input gradients" if call.backward else "outputs"
        if verdict is None or not await self._same_state([verdict[0], *verdict[1]]):
            self.counts.undecided += 1
            logger.warning(
                f"Spot check of stage {stage} (microbatch {microbatch_id}, step {step}): the {what} of "
                f"{', '.join(answers)} disagree and single out no one ({len(answers)} answers); no one is accused"
            )
            return
        await self._accuse(stage, step, microbatch_id, verdict, answers)

    async def _same_state(self, peers: list[str]) -> bool:
        """Whether `peers` announce the same (step, fingerprint) now: their disagreement is then no diverged state."""
        if self.p2p is None:
            return False
        try:
            infos = await asyncio.gather(*(get_peer_info(self.p2p, PeerID.from_base58(p), INFO_TIMEOUT) for p in peers))
        except StageCallError:
            return False
        return len({(i.step, i.fingerprint) for i in infos}) == 1

    async def _accuse(self, stage: int, step: int, microbatch_id: int, verdict, answers) -> None:
        accused, witnesses = verdict
        accusation = sign_accusation(
            self.signer,
            self.trainer_id,
            stage=stage,
            accused=accused,
            step=step,
            microbatch=microbatch_id,
            accused_digest=digest(answers[accused]),
            witness_digest=digest(answers[witnesses[0]]),
            witnesses=tuple(witnesses),
        )
        self.counts.accusations += 1
        self.mine.append(accusation)
        self.book.take([accusation])
        self.router.forget([accused])
        await self.publish()

    async def publish(self) -> None:
        """Stores this trainer's accusations in the DHT (renewed by the caller while it trains); never raises."""
        if not self.mine:
            return
        self._published = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, publish_accusations, self.dht, self.signer.run_id, list(self.mine))
        except Exception as e:
            logger.warning(f"Could not publish an accusation: {type(e).__name__}: {e}")


def spot_checker(config, caller, book: AccusationBook | None, trainer_id: str, dht: DHT) -> SpotChecker | None:
    """The spot checks of a trainer with a voucher in a swarm with a trust root (None otherwise, or with
    --spot-check-share 0). `caller` is its `StageCaller`: checks go through its `attempt`."""
    if config.spot_check_share <= 0 or caller.receipts is None or book is None:
        return None
    return SpotChecker(config.spot_check_share, caller.attempt, caller.router, caller.receipts, book, trainer_id, dht)
