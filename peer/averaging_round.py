"""The averaging round of a stage's step: every member steps on the same sum of the same contributions.

Accounting is by identity: every backward is named (trainer, microbatch), and contributions carry
which microbatches a peer holds. First every member offers its contribution: its sample count, the
microbatches in it, every microbatch it knows a member held, and its gradient's norm
(`GradContribution`, no gradient). Then every member tells the others which offers it holds
(`RoundCommit`); the contributions all hold are the round's. What the agreed contributions knew of
but do not hold was lost with a dead member: the stage goes short and the trainers are asked (in the
SHORT reply to their next forward) to send those microbatches again. It waits at most `short_wait`
seconds, then steps without them and counts them as lost, by id. Every decision is taken from the
agreed contributions alone, so every member takes the same one. Only then do gradients travel, in
slices (`slice_exchange`: reduce-scatter, then all-gather), summed in the order of the contributors'
peer ids, so all step on the same bits. A mate that cannot be reached is dropped from the round at
once; how long a phase waits for one, and how it learns that one died, is `round_waiting`'s. A member
that gives an attempt up (its offer for the next attempt arrives) is followed, not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable

import torch

from swarm.compression import Codec
from swarm.net.transport import GRAD_PROTOCOL
from swarm.net.wire import decode_tensors, encode_tensor, pack_frames
from swarm.peer.contribution_bounds import left_out
from swarm.peer.mate_membership import MateMembership
from swarm.peer.mate_messages import (
    Held,
    as_triples,
    check_header,
    check_ids,
    check_members,
    ids_from_wire,
    ids_to_wire,
    named_ids,
)
from swarm.peer.mate_progress import ProgressExchange
from swarm.peer.offer_answers import OfferAnswers
from swarm.peer.protocol_handler import protocol_handler
from swarm.peer.round_commits import RoundCommits, ViewsDiffer
from swarm.peer.round_waiting import RoundWaiting
from swarm.peer.runtime import RoundResult, SampleKey
from swarm.peer.slice_exchange import SliceExchange, SlicesFailed
from swarm.peer.step_machine import (
    ACCUMULATING,
    AVERAGING,
    SHORT,
    Contribution,
    RoundLeftBehind,
    StepMachine,
    StepState,
    carry_handovers,
    handed_twice,
    handovers_in,
    held_by_the_gone,
    named_in,
)
from swarm.peer.work_receipts import dropped_by, lost_with_the_dead
from swarm.proto import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    GradContribution,
    MateReply,
    Receipt,
    Voucher,
)

logger = logging.getLogger(__name__)


class AveragingRound:
    """This peer's side of its stage's averaging rounds, and its mates' contributions and commits to them."""

    def __init__(
        self,
        machine: StepMachine,
        membership: MateMembership,
        progress: ProgressExchange,
        averaging_timeout: float,
        short_wait: float,
        codec: Codec,
    ) -> None:
        self.machine = machine
        self.membership = membership
        self.progress = progress
        self.averaging_timeout = averaging_timeout
        self.short_wait = short_wait
        self.codec = codec
        self.rounds = 0
        self.dropped_members = 0
        self.samples_lost = 0
        self.samples_doubled = 0
        self.samples_left_out = 0  # of two mates' contributions, samples of one beyond the bound (`_left_out`)
        self.failed_rounds = 0  # rounds whose slices could not all be summed: retried without the dead
        # peers that asked for this peer's state: they will not contribute to the round under way
        self.departed: set[str] = set()
        self.answers = OfferAnswers()  # members whose offers this peer answers with its own
        self.handle_contribution = protocol_handler(
            GradContribution,
            self._new_reply,
            self._answer_contribution,
            machine.limits,
            failure="Failed to take gradients from {sender}",
        )
        # called when a round fails here that dead mates may have completed: this peer's history of `step` on
        # may fork from theirs (`StageMates` writes it to the ledger)
        self.on_fork: Callable[[int, set[str]], None] | None = None
        self.waiting = RoundWaiting(machine, membership, averaging_timeout)
        self.slices = SliceExchange(machine, membership, codec, averaging_timeout, self.waiting)
        self.commits = RoundCommits(machine, membership, self.waiting, averaging_timeout, self._offer_again)
        self.handle_commit = self.commits.handle

    @property
    def clipped_contributions(self) -> int:
        """Mates' gradient slices scaled down to the group's bound."""
        return self.slices.clipped_slices

    def depart(self, peer_id: str) -> None:
        """`peer_id` asked for this peer's state: the round under way stops waiting for it."""
        self.departed.add(peer_id)
        self.machine.changed.set()

    async def round(self, step: int, grad_sum: torch.Tensor | None, held: Held) -> RoundResult | None:
        """This peer's side of the averaging round at `step`: what the group agreed to step on, or None."""
        machine = self.machine
        state = machine.steps[step]
        state.phase = AVERAGING
        machine.stepped_without = -1  # a round starts only once a resync it waited for has ended (`advance`)
        started = machine.loop.time()
        try:
            try:
                result = await self._agree(step, state, grad_sum, held)
            except RoundLeftBehind as e:
                logger.info(f"Stage {machine.stage} step {step}: the round ends here, {e}")
                return None
            if result is not None:
                result.seconds = machine.loop.time() - started
            return result
        finally:
            if state.phase == AVERAGING:
                state.phase = ACCUMULATING
            machine.wake()
            machine.loop.call_soon(machine.advance, step)

    async def _agree(self, step: int, state: StepState, grad_sum: torch.Tensor | None, held: Held):
        machine = self.machine
        attempt = state.attempt
        give_up = machine.gives_up(step)  # any member's give-up is everyone's
        state.progress[machine.peer_id] = held
        box = state.mailbox[attempt]
        members = {machine.peer_id, *self.membership.mates, *state.progress} | named_in(box)
        # what the stage already waits for stays expected: a give-up round must count it as lost
        known = {**state.lost, **state.known()}
        norm = 0.0
        if grad_sum is not None:
            norm = await asyncio.get_running_loop().run_in_executor(None, lambda: float(grad_sum.norm()))
        own = Contribution(sum(held.values()), grad_sum, frozenset(members), held, known, give_up, norm)
        own.dropped.update(state.dropped.get(machine.peer_id, {}))
        if machine.receipts is not None:  # screened as the mates screen it, so that all decide alike
            own = self._screened(machine.peer_id, step, own, *self._receipts_of(own))
        box[machine.peer_id] = own
        if held:  # a fault test means a peer that dies holding samples, not one with nothing to lose
            await machine.faults.hit("before_contribution")
        try:
            moved_on = not await self._gather(step, attempt, state, members, own)
        finally:
            self.answers.gather_ended(step, attempt)
        await machine.faults.hit("after_contribution")
        try:
            agreed = None if moved_on else await self.commits.agree(step, attempt, state, set(box))
        except ViewsDiffer as e:
            self._retry(step, state, attempt, box, f"{e}; the next attempt starts from views read again")
            return None
        if agreed is None:  # a member gave this attempt up: what it has not sent will not come
            self._retry(step, state, attempt, box, f"a mate gave attempt {attempt} up: following it")
            return None
        if state.giver is not None and state.giver not in agreed and self.on_fork is not None:
            # the mate this peer took its state from at this step, gone from the round: it may have stepped on it
            # alone before dying (it leaves out of its round a peer it gives its state to), to other parameters
            self.on_fork(step, {state.giver})
            state.giver = None  # said once
        for peer in handed_twice(box, agreed):
            box[peer] = self._without_twice(step, peer, box[peer])
        contributions = [box[p] for p in sorted(agreed)]
        self.rounds += 1
        # everything below follows from the agreed contributions alone: every member decides alike
        expected: Held = {}
        for contribution in contributions:
            expected.update(contribution.known)
        summed: Counter[SampleKey] = Counter()
        for contribution in contributions:
            summed.update(contribution.held.keys())
        lost = {key: n for key, n in expected.items() if key not in summed}
        if machine.receipts is not None:
            holders: dict[SampleKey, frozenset[str]] = {}
            for contribution in contributions:
                for key, peers in (contribution.holders or {}).items():
                    holders[key] = holders.get(key, frozenset()) | peers
            lost = lost_with_the_dead(lost, holders, agreed, dropped_by({p: box[p] for p in agreed}))
        if lost and not any(c.give_up for c in contributions):
            self._go_short(step, state, attempt, agreed, box, lost)
            return None
        refused = self._left_out(step, box, agreed)
        # a contribution left out stays a member (it steps on the sum too) that sends no slices and counts no samples
        taken = {**box, **{p: dataclasses.replace(box[p], samples=0, grad_sum=None, held={}) for p in refused}}
        try:
            grad = await self.slices.run(step, attempt, state, sorted(agreed), taken)
        except SlicesFailed as e:
            self._retry(
                step, state, attempt, box, f"{e}; retrying it without {sorted(e.peers) or 'the mates that gave it up'}"
            )
            if e.stepped_elsewhere and self.on_fork is not None:
                self.on_fork(step, e.peers)
            return None
        left = {key: n for peer in refused for key, n in box[peer].held.items()}
        # what gone members were heard to hold after the offers were made: the next step's round expects it
        machine.steps[step + 1].lost.update(held_by_the_gone(state.progress, agreed | {machine.peer_id}, summed))
        return self._account(step, [taken[p] for p in sorted(agreed)], grad, expected, lost, left)

    def _left_out(self, step: int, box: dict[str, Contribution], agreed: set[str]) -> list[str]:
        """The peers whose contributions this round leaves out: of two, one beyond the bound (`left_out`)."""
        giving = [p for p in sorted(agreed) if box[p].samples > 0]
        per_sample = [box[p].norm / box[p].samples for p in giving]
        by_samples = self.machine.receipts is not None  # vouched counts: the bound is the median sample's
        refused = [giving[i] for i in left_out(per_sample, [box[p].samples for p in giving], by_samples)]
        for peer in refused:
            other = min(per_sample[i] for i, p in enumerate(giving) if p != peer)
            ratio = box[peer].norm / box[peer].samples / other if other > 0 else math.inf
            self.samples_left_out += box[peer].samples
            logger.warning(
                f"Stage {self.machine.stage} step {step}: the gradient of {peer} is {ratio:.3g} times the other "
                f"mate's per sample, beyond the bound; left out of the round with its {box[peer].samples} samples "
                f"(two mates: none to scale it toward; {self.samples_left_out} samples left out so far)"
            )
        return refused

    def _without_twice(self, step: int, peer: str, handover: Contribution) -> Contribution:
        """A hand-over that names a microbatch a member also holds, as the round takes it: without its gradient."""
        logger.warning(
            f"Stage {self.machine.stage} step {step}: the hand-over of {peer} names microbatches a member holds too "
            f"(its trainer sent them again, their holder counted dead); left out, {handover.samples} samples "
            "that no member holds are asked for again"
        )
        self.machine.steps[step].progress.pop(peer, None)  # it holds nothing that counts: their retries must sum
        self.progress.note_holdings()
        return dataclasses.replace(handover, samples=0, grad_sum=None, held={})

    def _account(
        self,
        step: int,
        contributions: list[Contribution],
        grad: torch.Tensor | None,
        expected: Held,
        lost: Held,
        left: Held,
    ) -> RoundResult:
        """The round's result: its summed gradient, its samples by id, and what it doubled, lost or left out."""
        stage = self.machine.stage
        total = sum(c.samples for c in contributions)
        ids: list[tuple[str, int, int]] = []
        summed: Counter[SampleKey] = Counter()
        for contribution in contributions:
            ids += as_triples(contribution.held)
            summed.update(contribution.held.keys())
        doubled = sum(expected.get(key, 0) * (count - 1) for key, count in summed.items() if count > 1)
        if doubled:
            self.samples_doubled += doubled
            logger.warning(
                f"Stage {stage} step {step}: {doubled} samples were held by two mates and count twice "
                f"(microbatches {sorted(mb for (_, mb), c in summed.items() if c > 1)})"
            )
        if lost:
            self.samples_lost += sum(lost.values())
            logger.warning(
                f"Stage {stage} step {step}: stepping without {sum(lost.values())} lost samples ({named_ids(lost)}: "
                f"their holder died, and their trainers did not send them again within {self.short_wait:.0f}s, "
                "finished training, or sent them again after the round began)"
            )
        if len(contributions) > 1:
            logger.debug(f"Stage {stage} step {step}: averaged {total} samples over {len(contributions)} peers")
        # samples left out are given up by id too, as the lost are; one a kept contribution holds as well counts there
        given_up = {**lost, **{key: n for key, n in left.items() if key not in summed}}
        return RoundResult(grad, total, ids, as_triples(given_up))

    def _retry(self, step: int, state: StepState, attempt: int, box: dict[str, Contribution], why: str) -> None:
        """The round cannot complete at this attempt (`why`): no member steps on it, and the stage tries again at
        the next, without the mates that failed it (what they held is then found lost, and asked for again)."""
        self.failed_rounds += 1
        state.attempt = max(state.attempt, attempt + 1)
        carry_handovers(box, state.mailbox[attempt + 1])
        logger.warning(f"Stage {self.machine.stage} step {step}: the round failed ({why}); attempt {attempt + 1} next")

    def _go_short(
        self, step: int, state: StepState, attempt: int, agreed: set[str], box: dict[str, Contribution], lost: Held
    ) -> None:
        """The round found samples missing: wait (bounded) for the trainers to send them again."""
        machine = self.machine
        state.phase = SHORT
        state.lost = lost
        state.attempt = attempt + 1
        # members outside the agreed set are gone: what they held is lost, as the agreed offers say, and as this
        # peer heard since (kept as expected by the next attempt, whose offers carry it to every member)
        summed = {key for peer in agreed for key in box[peer].held}
        state.lost.update(held_by_the_gone(state.progress, agreed | {machine.peer_id}, summed))
        for peer_id in [p for p in state.progress if p not in agreed and p != machine.peer_id]:
            del state.progress[peer_id]
        # no agreed member summed what is lost, whatever it said before: its trainers are asked for it again
        for peer_id, holdings in state.progress.items():
            if holdings.keys() & state.lost.keys():
                state.progress[peer_id] = {key: n for key, n in holdings.items() if key not in state.lost}
        self.progress.note_holdings()
        carry_handovers(box, state.mailbox[attempt + 1])  # what leaving mates handed over is still good as it is
        if state.short_deadline is None:
            state.short_deadline = machine.loop.time() + self.short_wait
            machine.loop.call_later(self.short_wait + 0.01, machine.advance, step)
        logger.warning(
            f"Stage {machine.stage} step {step}: a mate died holding {sum(lost.values())} samples ({len(lost)} "
            f"microbatches: {named_ids(lost)}); waiting up to {state.short_deadline - machine.loop.time():.0f}s for "
            f"their trainers to send them again (all that is now missing: {named_ids(state.lost)})"
        )

    # --- first phase: the contributions -------------------------------------------------------------------

    async def _gather(self, step: int, attempt: int, state: StepState, members: set[str], own: Contribution) -> bool:
        """First phase: offers this peer's contribution and waits for the members'; False if one moved on to the
        next attempt meanwhile (this peer must follow it)."""
        machine = self.machine
        box = state.mailbox[attempt]
        loop = asyncio.get_running_loop()
        unreachable: set[str] = set()
        sent, probed, again = {machine.peer_id}, {}, set()
        started = loop.time()
        offer_again = self._again(step, attempt, own, members, unreachable)  # `members` grows in place below
        while True:
            # a member that refused this offer and has since sent its own took a state meanwhile: it waits for this
            # one (sent again once: the probes' nudges only send this peer's offer to members it still waits for)
            refused = (unreachable & set(box)) - again - handovers_in(box)
            again |= refused
            unreachable -= refused
            for peer_id in (members - sent - handovers_in(box)) | refused:
                sent.add(peer_id)
                machine.spawn(self._send_contribution(peer_id, step, own, members, unreachable, attempt=attempt))
            machine.changed.clear()
            members |= named_in(box)
            missing = members - set(box) - unreachable - self.departed
            # a member that handed over is sent nothing: waiting to send it one held the round ABSENT_GRACE for naught
            if not missing and not (members - sent - handovers_in(box)):
                return True
            machine.check_left_behind(step)
            if state.attempt > attempt or missing & set(state.mailbox.get(attempt + 1, {})):
                return False
            self.waiting.probe_late(step, missing, probed, unreachable, offer_again)
            wait = self.waiting.wait_for(missing, started)
            if wait <= 0:
                self.dropped_members += len(missing)
                logger.warning(
                    f"Stage {machine.stage} step {step}: no gradients from {len(missing)} mate(s) within "
                    f"{loop.time() - started:.0f}s; averaging without them"
                )
                for peer_id in missing - {p for p in missing if self.waiting.worked(p)}:
                    self.membership.mark_unreachable(peer_id)  # until it says something: it never worked
                return True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(machine.changed.wait(), wait)

    def _again(self, step: int, attempt: int, own: Contribution, members: set[str], unreachable: set[str]):
        """Sends this peer's offer again to a member that a phase waits for and that lives at its step."""
        send = self._send_contribution
        return lambda peer: self.machine.spawn(send(peer, step, own, members, unreachable, attempt=attempt))

    def _offer_again(self, step: int, attempt: int, members: set[str], gone: set[str]):
        """`_again` for this peer's offer of `attempt` at `step` (the commits' phase waits with it)."""
        own = self.machine.steps[step].mailbox[attempt][self.machine.peer_id]
        return self._again(step, attempt, own, members, gone)

    async def _send_contribution(
        self,
        peer_id: str,
        step: int,
        own: Contribution,
        members: set[str],
        unreachable: set[str],
        handover: bool = False,
        attempt: int = 0,
    ) -> None:
        machine = self.machine
        if peer_id in self.membership.accused:  # accused or caught lying: no member of this peer's rounds
            unreachable.add(peer_id)
            machine.changed.set()
            return
        header = GradContribution(
            protocol_version=PROTOCOL_VERSION,
            model=machine.model,
            stage=machine.stage,
            step=step,
            samples=own.samples,
            members=sorted(members),
            handover=handover,
            attempt=attempt,
            held=ids_to_wire(own.held),
            known=ids_to_wire(own.known),
            give_up=own.give_up,
            norm=own.norm,
            dropped=ids_to_wire(own.dropped),
        )
        if machine.receipts is not None:
            receipts, vouchers = self._receipts_of(own)
            header.receipts.extend(receipts)
            header.vouchers.extend(vouchers)
        loop = asyncio.get_running_loop()
        parts = []
        if handover and own.grad_sum is not None:  # a leaving peer sends its whole gradient: it owns no slice
            parts = await loop.run_in_executor(None, encode_tensor, own.grad_sum, self.codec)
        timeout = self.waiting.call_timeout(peer_id)
        reply = await machine.call_mate(peer_id, GRAD_PROTOCOL, pack_frames(header, parts), timeout)
        if isinstance(reply, Exception):
            logger.warning(f"Stage {machine.stage} step {step}: mate {peer_id} is unreachable ({reply}); dropping it")
            self.membership.mark_unreachable(peer_id)
        elif reply.error.code == ErrorCode.OK:
            return
        else:
            if reply.error.code == ErrorCode.OUT_OF_SYNC and reply.step > step:
                machine.mate_stepped_past(step, peer_id, reply.step)
            logger.warning(
                f"Stage {machine.stage} step {step}: mate {peer_id} refused gradients: {reply.error.message}"
            )
        unreachable.add(peer_id)
        machine.changed.set()

    def _new_reply(self) -> MateReply:
        return MateReply(protocol_version=PROTOCOL_VERSION, step=self.machine.runtime.step)

    async def _answer_contribution(self, sender: str, header: GradContribution, parts: list, reply: MateReply) -> list:
        self.membership.heard_from(sender)
        if header.handover:  # whatever its step: it leaves the stage, and no round of this peer waits for it again
            self.membership.mark_left(sender)
            self.depart(sender)
            if header.samples == 0 and header.step != self.machine.runtime.step:
                return Error(code=ErrorCode.OK)  # holding nothing, it says only that: no claim of a step
        reply.error.CopyFrom(await self._accept_contribution(sender, header, parts))
        return [reply]

    async def _accept_contribution(self, sender: str, header: GradContribution, parts: list) -> Error:
        machine = self.machine
        error = check_header(header, machine.model, machine.stage)
        error = error or check_ids(machine.runtime.max_batch_samples, header.held, header.known, header.dropped)
        if (error := error or check_members(header.members)) is not None:
            return error
        if header.samples != sum(i.samples for i in header.held):
            # the count is what the round steps on: it must be the microbatches named, not a number sent
            return Error(code=ErrorCode.BAD_REQUEST, message="samples do not add up to the microbatches held")
        if machine.receipts is not None and len(header.receipts) > machine.receipts.max_shown(machine.runtime):
            return Error(code=ErrorCode.BAD_REQUEST, message="more receipts than a step has microbatches")
        step = machine.runtime.step
        # a peer that has just loaded a mate's state takes part in rounds before it serves; while it loads,
        # the round its source holds at the step it hands over waits for it: refusing would split the group
        loading = sender == self.membership.state_source and header.step >= step
        if not (step <= header.step <= step + 1 or loading):
            if header.step > step:
                machine.claim_ahead(sender, header.step)
            return Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at step {step}, not {header.step}")
        if not math.isfinite(header.norm) or header.norm < 0:
            return Error(code=ErrorCode.BAD_REQUEST, message="a gradient norm that is no norm")
        if parts and not header.handover:
            return Error(code=ErrorCode.BAD_REQUEST, message="gradients travel in slices, after the commits")
        grad_sum = None
        if header.handover and header.samples > 0:
            tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, machine.limits)
            size = machine.num_parameters
            if len(tensors) != 1 or tensors[0].shape != (size,) or tensors[0].dtype != torch.float32:
                return Error(code=ErrorCode.BAD_REQUEST, message=f"expected one float32[{size}]")
            if not torch.isfinite(tensors[0]).all():
                return Error(code=ErrorCode.BAD_REQUEST, message="gradients hold NaN or infinity")
            grad_sum = tensors[0]
        state = machine.steps[header.step]
        if loading:
            state.attempt = max(state.attempt, header.attempt)  # the source's rounds so far at that step
        # a leaving peer's gradients are good for any attempt: into the one under way
        attempt = max(header.attempt, state.attempt) if header.handover else header.attempt
        if attempt < state.attempt:
            return Error(code=ErrorCode.OK)  # from a round already found short here: superseded
        if attempt > state.attempt + 1:
            return Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at round attempt {state.attempt}")
        if attempt == state.attempt + 1 and state.phase != AVERAGING:
            # the mates retry a round this peer missed (it joined since, or heard of the loss later): join it
            state.attempt = attempt
        held = ids_from_wire(header.held)
        contribution = Contribution(
            sum(held.values()),
            grad_sum,
            frozenset(header.members),
            held,
            ids_from_wire(header.known),
            header.give_up,
            header.norm,
            header.handover,
            dropped=ids_from_wire(header.dropped),
        )
        if machine.receipts is not None:  # only what vouched trainers gave counts
            contribution = self._screened(sender, header.step, contribution, header.receipts, header.vouchers)
        repeat = sender in state.mailbox[attempt]
        state.mailbox[attempt][sender] = contribution
        own = state.mailbox[attempt].get(machine.peer_id)
        if not header.handover and own is not None and self.answers.should_answer(sender, header.step, attempt, repeat):
            self._again(header.step, attempt, own, set(own.members), set())(sender)
        if header.handover and header.step == machine.runtime.step:
            # a hand-over is its sender's last word on what it holds toward the step. What it handed over is held: a
            # trainer's retry of one of those microbatches (the round may have counted it lost with its holder, which
            # stopped answering to leave) is answered here without summing it twice. What it said it held before
            # and did not hand over (in a round it left) is held by no one: claimed still, a short round found it
            # held again at once, round after round for 20 s, and its trainers were never asked for it
            state.progress[sender] = dict(contribution.held)
            self.progress.note_holdings()
        machine.changed.set()
        if not header.handover:  # a leaving peer's gradients wait for the round the stage would hold anyway
            machine.advance(header.step)
        return Error(code=ErrorCode.OK)

    def _receipts_of(self, own: Contribution) -> tuple[list[Receipt], list[Voucher]]:
        """The receipts this peer shows for a contribution: of what it holds, and of what it knows mates held."""
        return self.machine.receipts.shown({**own.held, **own.dropped}, own.known)

    def _screened(self, sender: str, step: int, contribution: Contribution, receipts, vouchers) -> Contribution:
        """`contribution` as it counts: only the microbatches good receipts name its holder for."""
        screened = self.machine.receipts.screen(
            sender, step, contribution.held, contribution.known, receipts, vouchers, contribution.dropped
        )
        return dataclasses.replace(
            contribution,
            samples=sum(screened.held.values()),
            grad_sum=contribution.grad_sum if screened.held else None,
            held=screened.held,
            known=screened.known,
            holders=screened.holders,
            dropped=screened.dropped,
        )

    # --- a leaving peer --------------------------------------------------------------------------------------

    async def hand_over(self, timeout: float = 10.0) -> tuple[int, Held, int] | None:
        """Sends this peer's un-averaged gradients to its mates before it leaves, so its samples still count.

        Returns (step, the samples held, how many mates took them), or None if it held none."""
        machine, membership = self.machine, self.membership
        if not machine.serving:
            return None
        machine.serving = False  # no new rounds and no resyncs from here on
        runtime = machine.runtime
        step, grad_sum, held = await asyncio.wrap_future(
            runtime.run_exclusive(lambda: (runtime.step, runtime.flat_gradient(), dict(runtime.held)))
        )
        if not membership.mates:
            return (step, held, 0) if held else None
        # holding nothing, it still says it leaves: its record outlives the move (a restorer's by seconds), and
        # its mates' rounds waited for it until a call to it was refused, past the restore, on a stage-loss step
        grad_sum = grad_sum if held else None
        members = {machine.peer_id, *membership.mates}
        state = machine.steps[step]
        norm = float(grad_sum.norm()) if grad_sum is not None else 0.0
        own = Contribution(sum(held.values()), grad_sum, frozenset(members), held, state.known(), norm=norm)
        unreachable: set[str] = set()
        sends = [
            self._send_contribution(p, step, own, members, unreachable, handover=True, attempt=state.attempt)
            for p in membership.mates
        ]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), timeout)
        if not held:
            return None
        taken = len(membership.mates) - len(unreachable)
        logger.info(f"Handed {own.samples} samples of step {step} to {taken} of {len(membership.mates)} stage-mate(s)")
        return step, held, taken
