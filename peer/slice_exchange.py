"""The gradient half of an averaging round: reduce-scatter, then all-gather, between the agreed members.

The members have agreed on the round's contributors (`averaging_round`). Each member sends slice i of
its gradient sum to the i-th owner (`round_slices.slice_owners`), sums its own slice of every
contribution in the contributors' order, and sends that sum to every member. A member sends and
receives about two gradient sizes per round however many mates there are, and holds one gradient and
its slices rather than one gradient per mate.

A mate that dies mid-round (its probes fail, see `round_waiting`): a member missing an owner's sum
asks the other members for their copy of it (every copy is the same bits), so an owner that died
after sending its sum to one member costs nothing. An owner that cannot sum its slice (a contribution's
slice never came) says so, and then no member can have that slice: the round fails alike for all,
and the step machine retries it without the dead, whose samples the stage then asks for again (see
`averaging_round`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Callable

import torch
from hivemind.p2p import PeerID

from swarm.compression import Codec
from swarm.net.transport import SLICE_PROTOCOL, exchange
from swarm.net.wire import decode_tensors, encode_tensor, pack_frames
from swarm.peer.contribution_bounds import centered_sum
from swarm.peer.mate_membership import MateMembership
from swarm.peer.mate_messages import MAX_MEMBERS, check_header
from swarm.peer.protocol_handler import protocol_handler
from swarm.peer.round_slices import (
    AUDIT_PROJECTIONS,
    SliceInbox,
    SliceMessage,
    contributors_digest,
    owner_scales,
    reduce_slice,
    slice_bounds,
    slice_length,
    slice_owners,
    squared_norms,
)
from swarm.peer.round_waiting import RoundWaiting
from swarm.peer.slice_audit import answer_audit, audit_seeds, audit_sums, seeds_for_owner
from swarm.peer.step_machine import Contribution, StepMachine, StepState
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, MateReply, RoundSlice, SliceKind

logger = logging.getLogger(__name__)

KEPT_ROUNDS = 2  # rounds whose summed slices this peer keeps, for members that missed an owner's
FETCH_AFTER = 1.0  # seconds a member waits for a late owner's sum before asking the other members for it
RESEND_PAUSE = 0.25  # seconds between sends of a slice to a mate that refused it from behind the round


def refused_from_behind(reply: MateReply, step: int) -> bool:
    """Whether a mate refused a message of the round at `step` because it is behind that round (an earlier step,
    or an earlier attempt at it): it is taking a state, and takes part once it has."""
    return reply.error.code == ErrorCode.OUT_OF_SYNC and reply.step <= step


class SlicesFailed(Exception):
    """This member cannot complete the round: a slice could not be summed or had. `peers` are the mates to blame;
    `stepped_elsewhere`: they may have completed it themselves (an owner that died holding every sum, its own
    included, may have stepped on the round before it died)."""

    def __init__(self, message: str, peers: set[str], stepped_elsewhere: bool = False) -> None:
        super().__init__(message)
        self.peers = peers
        self.stepped_elsewhere = stepped_elsewhere


class SliceExchange:
    """This peer's side of the slices of its stage's rounds: sends, sums, gathers, and answers mates."""

    def __init__(
        self,
        machine: StepMachine,
        membership: MateMembership,
        codec: Codec,
        averaging_timeout: float,
        waiting: RoundWaiting,
    ) -> None:
        self.machine = machine
        self.membership = membership
        self.codec = codec
        self.averaging_timeout = averaging_timeout
        self.waiting = waiting  # how long to wait for missing members, and probing them
        self.bytes_sent = 0  # gradient bytes this peer sent in rounds, slices and sums
        self.bytes_received = 0
        self.false_norms = 0  # contributions whose slices held more than their sender stated
        self.clipped_slices = 0
        # --robust-sum centered-clip: this peer's slices are summed with `centered_sum` (exact otherwise)
        self.centered = False
        self.centered_slices = 0  # slices summed robustly: a contribution stood out from the others
        self.caught_owners = 0  # owners whose sums this peer's audit refuted
        # (step, attempt, digest) -> summed slices this peer holds, by index
        self.kept: OrderedDict[tuple[int, int, bytes], dict[int, torch.Tensor]] = OrderedDict()
        # (step, attempt, digest) -> the round's slice owners: a mate asking for a dead owner's sum is answered with
        # the one received here before this peer's own gather ended (it asks at once when the owner refuses a dial)
        self.owners: OrderedDict[tuple[int, int, bytes], list[str]] = OrderedDict()
        # (step, attempt) -> members this peer's slice messages could not reach, or that refused one: gone for it
        self.unsent: OrderedDict[tuple[int, int], set[str]] = OrderedDict()
        self.handle = protocol_handler(
            RoundSlice, self._new_reply, self._answer, machine.limits, failure="Failed to take a slice from {sender}"
        )

    async def run(
        self, step: int, attempt: int, state: StepState, senders: list[str], box: dict[str, Contribution]
    ) -> torch.Tensor | None:
        """The round's summed gradient (None: no contribution holds one); raises SlicesFailed."""
        machine = self.machine
        handovers = {p for p in senders if box[p].handover}
        owners = slice_owners(senders, handovers)
        if not any(box[p].samples > 0 for p in senders):
            return None
        digest = contributors_digest(step, attempt, senders)
        self.owners[(step, attempt, digest)] = owners
        while len(self.owners) > KEPT_ROUNDS:
            self.owners.popitem(last=False)
        bounds = slice_bounds(machine.num_parameters, len(owners))
        mine = owners.index(machine.peer_id)
        head = dict(step=step, attempt=attempt, count=len(owners), contributors=digest)
        own = box[machine.peer_id]
        await machine.faults.hit("before_slices")
        if owners == [machine.peer_id] and [p for p in senders if box[p].samples > 0] == [machine.peer_id]:
            # alone: the sum is this peer's own gradient, with nothing to bound it against and no mate to decode
            # the same bits; norms, a copy and a codec's round trip over the whole gradient would change nothing
            return own.grad_sum
        sends = []
        # this member audits the other owners' sums where they are plain weighted sums of what it can project
        seeds = audit_seeds(len(owners), mine) if own.samples > 0 and self._audited() else []
        if own.samples > 0:
            for index, owner in enumerate(owners):
                if owner != machine.peer_id:
                    lo, hi = bounds[index]
                    part = RoundSlice(**head, kind=SliceKind.PART, index=index)
                    part.audit_seeds.extend(seeds_for_owner(seeds, index) if seeds else [])
                    sends.append(machine.spawn(self._send(owner, part, own.grad_sum[lo:hi])))
        inbox = state.inbox[attempt]
        summed = await self._reduce(step, attempt, state, senders, box, owners, bounds[mine], digest)
        others = [owner for owner in owners if owner != machine.peer_id]
        if summed is None:
            for owner in others:
                machine.spawn(self._send(owner, RoundSlice(**head, kind=SliceKind.FAILED, index=mine)))
            missing = {p for p in others if box[p].samples > 0} - set(inbox.parts)
            raise SlicesFailed(f"slice {mine} lacks the parts of {len(missing)} mate(s)", missing)
        total, norms = summed
        self._keep((step, attempt, digest), {mine: total})
        await asyncio.gather(*sends, return_exceptions=True)  # the parts go out first: mates wait on them to sum
        own_grad = own.grad_sum if own.samples > 0 else None
        for position, owner in enumerate(others):
            reduced = RoundSlice(**head, kind=SliceKind.REDUCED, index=mine, slice_norms=norms)
            if (asked := inbox.parts.get(owner)) is not None and asked.audit_seeds:
                reduced.audits.extend(await self._in_executor(answer_audit, asked.audit_seeds, own_grad, bounds))
            sending = machine.spawn(self._send(owner, reduced, total))
            # the sums go out together: the first awaited alone held the others behind a dead owner's refused dial
            if position == 0 and machine.faults.planned("after_first_sum"):
                await asyncio.gather(sending, return_exceptions=True)
                await machine.faults.hit("after_first_sum")
        pieces = await self._gather(step, attempt, state, owners, bounds, digest)
        if seeds:
            self._audit(
                step, await self._in_executor(self._audit_sums, seeds, owners, senders, box, bounds, pieces, inbox)
            )
        self._keep((step, attempt, digest), pieces)
        return await self._in_executor(lambda: torch.cat([pieces[i] for i in range(len(owners))]))

    @staticmethod
    async def _in_executor(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # --- audit: the other owners' sums (see `slice_audit`) ------------------------------------------------------

    def _audited(self) -> bool:
        """Whether this peer's rounds sum slices plainly, so that their sums can be audited."""
        return not self.centered and not self.codec.lossy

    def _audit_sums(self, seeds, owners, senders, box, bounds, pieces, inbox) -> tuple[dict[str, str], list[str]]:
        contributing = [p for p in senders if box[p].samples > 0]
        by_samples = self.machine.receipts is not None
        me = self.machine.peer_id
        return audit_sums(me, seeds, owners, contributing, box, bounds, pieces, inbox.reduced, by_samples)

    def _audit(self, step: int, found: tuple[dict[str, str], list[str]]) -> None:
        """Leaves the owners caught lying out from now on and fails the round: no member steps on a refuted sum,
        nor on one summed over other contributions than this member's."""
        caught, disagreeing = found
        if disagreeing and not caught:
            raise SlicesFailed(
                f"the sums of {len(disagreeing)} owner(s) cover other contributions than this peer's", set()
            )
        for owner, why in caught.items():
            self.caught_owners += 1
            logger.warning(
                f"Stage {self.machine.stage} step {step}: owner {owner} lied about its sum: {why}; it is left out of "
                "this peer's rounds and state sources from now on"
            )
            self.membership.catch(owner, why)
        if caught:
            raise SlicesFailed(f"{len(caught)} owner(s) returned a sum their mates' parts refute", set(caught))

    # --- reduce: this peer's slice ----------------------------------------------------------------------

    async def _reduce(
        self,
        step: int,
        attempt: int,
        state: StepState,
        senders: list[str],
        box: dict[str, Contribution],
        owners: list[str],
        bound: tuple[int, int],
        digest: bytes,
    ) -> tuple[torch.Tensor, list[float]] | None:
        """This peer's slice summed over every contribution, and their squared slice norms; None if it cannot be."""
        machine = self.machine
        index = owners.index(machine.peer_id)
        inbox = state.inbox[attempt]
        expected = {p for p in owners if p != machine.peer_id and box[p].samples > 0}

        def done() -> bool | None:
            fitting = {p for p in expected if p in inbox.parts and inbox.parts[p].fits(digest, len(owners), index)}
            if fitting == expected:
                return True
            if any(p in inbox.parts for p in expected - fitting):
                logger.warning(f"Stage {machine.stage} step {step}: a mate sent a slice of a round agreed otherwise")
                return False
            return None

        if not await self._wait(step, attempt, state, done, lambda: expected - set(inbox.parts)):
            return None
        lo, hi = bound
        contributing = [p for p in senders if box[p].samples > 0]

        def pieces() -> list[torch.Tensor]:
            return [
                inbox.parts[p].tensor if p in expected else box[p].grad_sum[lo:hi]  # own, or a hand-over's
                for p in contributing
            ]

        def add_up() -> tuple[torch.Tensor, list[float]]:
            taken = pieces()
            squares = squared_norms(taken)
            claims = [box[p].norm for p in contributing]
            seen = [math.sqrt(s) for s in squares]
            # with a trust root the sample counts are vouched for: the bound is the median sample's
            by_samples = machine.receipts is not None
            counts = [box[p].samples for p in contributing]
            scales = owner_scales(claims, seen, counts, by_samples)
            self._note_bounds(step, contributing, claims, seen, scales)
            total = reduce_slice(taken, scales)
            # with three or more, a contribution far from the others pulls the sum only so far
            robust, outliers = None, []
            if self.centered:
                robust, outliers = centered_sum([p if s == 1.0 else p * s for p, s in zip(taken, scales)], counts)
            if robust is not None:
                total = robust
                self._note_outliers(step, [contributing[i] for i in outliers])
            if self.codec.lossy:  # every member must hold the bits the others decode
                total = decode_tensors(encode_tensor(total, self.codec), machine.limits)[0]
            return total, squares

        return await asyncio.get_running_loop().run_in_executor(None, add_up)

    def _note_bounds(
        self, step: int, senders: list[str], claims: list[float], seen: list[float], scales: list[float]
    ) -> None:
        for sender, claim, norm, scale in zip(senders, claims, seen, scales):
            if norm > claim * 1.001:
                self.false_norms += 1
                logger.warning(
                    f"Stage {self.machine.stage} step {step}: mate {sender} stated a gradient norm of {claim:.4g}, "
                    f"its slice alone holds {norm:.4g}; bounded by the slice ({self.false_norms} so far)"
                )
            if scale < 1.0:
                self.clipped_slices += 1
                logger.warning(
                    f"Stage {self.machine.stage} step {step}: the gradient of {sender} is {1 / scale:.3g} times "
                    f"the group's bound; scaled down to it ({self.clipped_slices} slices clipped so far)"
                )

    def _note_outliers(self, step: int, senders: list[str]) -> None:
        self.centered_slices += 1
        logger.warning(
            f"Stage {self.machine.stage} step {step}: the gradient of {', '.join(senders) or 'a mate'} lies far "
            f"from the others'; summed with CenteredClip ({self.centered_slices} slices so far)"
        )

    # --- gather: every owner's slice --------------------------------------------------------------------

    async def _gather(
        self,
        step: int,
        attempt: int,
        state: StepState,
        owners: list[str],
        bounds: list[tuple[int, int]],
        digest: bytes,
    ) -> dict[int, torch.Tensor]:
        """Every owner's summed slice, by index; raises SlicesFailed if one cannot be had."""
        inbox = state.inbox[attempt]
        pieces = dict(self.kept[(step, attempt, digest)])
        count = len(owners)

        def collect() -> bool | None:
            for index, owner in enumerate(owners):
                message = inbox.reduced.get(owner)
                if index not in pieces and message is not None and message.fits(digest, count, index):
                    pieces[index] = message.tensor
            if len(pieces) == count:
                return True
            if any(owners[i] in inbox.failed for i in range(count) if i not in pieces):
                return False
            return None

        def missing() -> set[str]:
            return {owners[i] for i in range(count) if i not in pieces}

        done = await self._wait(step, attempt, state, collect, missing, patience=FETCH_AFTER)
        late = missing()
        if not done and not self._given_up(state, attempt, late) and not late & inbox.failed:
            # an owner is late or gone: it may have died after giving its sum to a mate; the other owners, alive
            # and late (one may still be failing to reach the dead), are waited for again once it is fetched
            for index in [i for i in range(count) if i not in pieces]:
                if (fetched := await self._fetch(step, attempt, digest, index, count, owners)) is not None:
                    pieces[index] = fetched
            done = await self._wait(step, attempt, state, collect, missing)
        if not done:
            failed = {owners[i] for i in range(count) if i not in pieces and owners[i] in inbox.failed}
            if failed:
                raise SlicesFailed(f"{len(failed)} mate(s) could not sum their slice", set())
        for index in [i for i in range(count) if i not in pieces]:
            fetched = await self._fetch(step, attempt, digest, index, count, owners)
            if fetched is None:
                raise SlicesFailed(f"no member holds the sum of slice {index}", {owners[index]}, stepped_elsewhere=True)
            pieces[index] = fetched
        return pieces

    async def _fetch(
        self, step: int, attempt: int, digest: bytes, index: int, count: int, owners: list[str]
    ) -> torch.Tensor | None:
        """Slice `index`'s sum from any member that holds it (its owner is gone), or None."""
        machine = self.machine
        request = RoundSlice(
            protocol_version=PROTOCOL_VERSION,
            model=machine.model,
            stage=machine.stage,
            step=step,
            attempt=attempt,
            kind=SliceKind.FETCH,
            index=index,
            count=count,
            contributors=digest,
        )
        for peer_id in [p for i, p in enumerate(owners) if i != index and p != machine.peer_id]:
            try:
                reply, parts = await asyncio.wait_for(
                    exchange(
                        machine.p2p, PeerID.from_base58(peer_id), SLICE_PROTOCOL, [request], MateReply, machine.limits
                    ),
                    self.averaging_timeout,
                )
                if reply.error.code != ErrorCode.OK:
                    continue
                tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, machine.limits)
            except Exception as e:
                logger.debug(f"Could not fetch slice {index} from {peer_id}: {e!r}")
                continue
            if self._slice_problem(tensors, count, index) is None:
                self.bytes_received += sum(len(part.buffer) for part in parts)
                logger.info(f"Stage {machine.stage} step {step}: took slice {index}'s sum from {peer_id}")
                return tensors[0]
        return None

    async def _wait(
        self,
        step: int,
        attempt: int,
        state: StepState,
        check: Callable[[], bool | None],
        missing: Callable[[], set[str]],
        patience: float | None = None,
    ) -> bool | None:
        """Waits until `check` says True (done) or False (failed), the mates lapse, or a member moved on;
        None once `patience` seconds have passed without either."""
        machine = self.machine
        started = machine.loop.time()
        gone: set[str] = set()
        probed: dict[str, float] = {}
        while True:
            machine.changed.clear()
            verdict = check()
            if verdict is not None:
                return verdict
            machine.check_left_behind(step)
            if patience is not None and machine.loop.time() >= started + patience:
                return None
            if self._given_up(state, attempt, missing()):
                return False
            if missing() & gone:
                return False  # a member died: what it has not sent will not come
            if unreached := missing() & self.unsent.get((step, attempt), set()):
                # a killed mate refuses the connection at once; waiting for a probe to say so held the round seconds
                logger.warning(
                    f"Stage {machine.stage} step {step}: this peer's slices could not reach {sorted(unreached)}, or "
                    "were refused; giving this attempt of the round up without waiting for them"
                )
                return False
            self.waiting.probe_late(step, missing(), probed, gone)
            wait = self.waiting.wait_for(missing(), started)
            if patience is not None:
                wait = min(wait, max(0.01, started + patience - machine.loop.time()))
            if wait <= 0:
                logger.warning(
                    f"Stage {machine.stage} step {step}: no slices from {len(missing())} mate(s) within "
                    f"{machine.loop.time() - started:.0f}s"
                )
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(machine.changed.wait(), wait)

    @staticmethod
    def _given_up(state: StepState, attempt: int, missing: set[str]) -> bool:
        """Whether this peer or a member in `missing` gave `attempt` up: what the member has not sent will not come."""
        return state.attempt > attempt or any(p in state.mailbox.get(attempt + 1, {}) for p in missing)

    def _keep(self, key: tuple[int, int, bytes], pieces: dict[int, torch.Tensor]) -> None:
        self.kept.setdefault(key, {}).update(pieces)
        self.kept.move_to_end(key)
        while len(self.kept) > KEPT_ROUNDS:
            self.kept.popitem(last=False)

    # --- sending ---------------------------------------------------------------------------------------------

    async def _send(self, peer_id: str, message: RoundSlice, tensor: torch.Tensor | None = None) -> None:
        """Sends a slice message; one refused by a mate that is behind the round (it is still taking a state) goes
        again every `RESEND_PAUSE` seconds while this peer's attempt stands: that mate waits on it once caught up."""
        machine = self.machine
        message.protocol_version, message.model, message.stage = PROTOCOL_VERSION, machine.model, machine.stage
        parts = []
        if tensor is not None:
            parts = await asyncio.get_running_loop().run_in_executor(None, encode_tensor, tensor, self.codec)
        frames = pack_frames(message, parts)
        deadline = machine.loop.time() + self.averaging_timeout
        while True:
            reply = await machine.call_mate(peer_id, SLICE_PROTOCOL, frames, self.averaging_timeout, machine.limits)
            behind = not isinstance(reply, Exception) and refused_from_behind(reply, message.step)
            if not (behind and self._stands(message) and machine.loop.time() + RESEND_PAUSE < deadline):
                break
            await asyncio.sleep(RESEND_PAUSE)
        if isinstance(reply, Exception):
            logger.warning(f"Stage {machine.stage} step {message.step}: mate {peer_id} is unreachable ({reply})")
            self.membership.mark_unreachable(peer_id)
        elif reply.error.code == ErrorCode.OK:
            self.bytes_sent += sum(len(part.buffer) for part in parts)
            return
        elif reply.error.code == ErrorCode.OUT_OF_SYNC and reply.step > message.step:
            machine.mate_stepped_past(message.step, peer_id, reply.step)
        else:
            logger.warning(f"Stage {machine.stage}: mate {peer_id} refused a slice: {reply.error.message}")
        # it will not have this attempt's slice (it died, moved to another stage, or refused it): the wait for it
        # ends at once (a mate that moved lives on and answers probes from its new stage only after a while)
        self.unsent.setdefault((message.step, message.attempt), set()).add(peer_id)
        while len(self.unsent) > KEPT_ROUNDS:
            self.unsent.popitem(last=False)
        machine.changed.set()

    def _stands(self, message: RoundSlice) -> bool:
        """Whether this peer is still in the round attempt `message` belongs to."""
        state = self.machine.steps.get(message.step)
        return self.machine.runtime.step == message.step and state is not None and state.attempt == message.attempt

    # --- answering mates ---------------------------------------------------------------------------------------

    def _new_reply(self) -> MateReply:
        return MateReply(protocol_version=PROTOCOL_VERSION, step=self.machine.runtime.step)

    async def _answer(self, sender: str, message: RoundSlice, parts: list, reply: MateReply) -> list:
        self.membership.heard_from(sender)
        error = check_header(message, self.machine.model, self.machine.stage)
        if error is None and not (0 < message.count <= MAX_MEMBERS and message.index < message.count):
            error = Error(code=ErrorCode.BAD_REQUEST, message=f"slice {message.index} of {message.count}")
        if error is None and message.kind == SliceKind.FETCH:
            return self._fetched(message, reply)
        error = error or await self._take(sender, message, parts)
        if error is not None:
            reply.error.CopyFrom(error)
        return [reply]

    async def _take(self, sender: str, message: RoundSlice, parts: list) -> Error | None:
        """Files a mate's slice, sum or failure with the round it names, once checked."""
        machine = self.machine
        step = machine.runtime.step
        if not step <= message.step <= step + 1:
            return Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at step {step}, not {message.step}")
        state = machine.steps[message.step]
        if message.attempt < state.attempt:
            return None  # a round already given up here
        if message.attempt > state.attempt + 1:
            return Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at round attempt {state.attempt}")
        inbox: SliceInbox = state.inbox[message.attempt]
        if message.kind == SliceKind.FAILED:
            inbox.failed.add(sender)
            machine.changed.set()
            return None
        if message.kind not in (SliceKind.PART, SliceKind.REDUCED):
            return Error(code=ErrorCode.BAD_REQUEST, message=f"unknown slice kind {message.kind}")
        if len(message.slice_norms) > MAX_MEMBERS:
            return Error(code=ErrorCode.BAD_REQUEST, message=f"more than {MAX_MEMBERS} slice norms")
        if len(message.audit_seeds) not in (0, message.count) or len(message.audits) not in (
            0,
            message.count * AUDIT_PROJECTIONS,
        ):
            return Error(code=ErrorCode.BAD_REQUEST, message="audit seeds or projections of another round's size")
        if not all(math.isfinite(x) for x in message.audits):
            return Error(code=ErrorCode.BAD_REQUEST, message="a non-finite audit projection")
        tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, machine.limits)
        if (problem := self._slice_problem(tensors, message.count, message.index)) is not None:
            return Error(code=ErrorCode.BAD_REQUEST, message=problem)
        self.bytes_received += sum(len(part.buffer) for part in parts)
        filed = SliceMessage(bytes(message.contributors), message.count, message.index, tensors[0])
        if message.kind == SliceKind.PART:
            filed.audit_seeds = list(message.audit_seeds)
            inbox.parts[sender] = filed
        else:
            filed.slice_norms = list(message.slice_norms)
            filed.audits = list(message.audits)
            inbox.reduced[sender] = filed
        machine.changed.set()
        return None

    def _slice_problem(self, tensors: list[torch.Tensor], count: int, index: int) -> str | None:
        """What is wrong with a mate's slice `index` of `count` (a part, a sum or a fetched sum), if anything."""
        length = slice_length(self.machine.num_parameters, count, index)
        if len(tensors) != 1 or tensors[0].shape != (length,) or tensors[0].dtype != torch.float32:
            return f"expected one float32[{length}]"
        if not torch.isfinite(tensors[0]).all():
            return "a slice holds NaN or infinity"
        return None

    def _fetched(self, message: RoundSlice, reply: MateReply) -> list:
        """A sum of the slice asked for, kept or as its owner sent it here, or NOT found (UNAVAILABLE)."""
        key = (message.step, message.attempt, bytes(message.contributors))
        tensor = self.kept.get(key, {}).get(message.index)
        if tensor is None:
            tensor = self._received_sum(key, message.count, message.index)
        if tensor is None:
            reply.error.CopyFrom(Error(code=ErrorCode.UNAVAILABLE, message=f"no sum of slice {message.index} here"))
            return [reply]
        return pack_frames(reply, encode_tensor(tensor, self.codec))

    def _received_sum(self, key: tuple[int, int, bytes], count: int, index: int) -> torch.Tensor | None:
        """Slice `index`'s sum as its owner sent it to this peer, for a round whose gather has not ended here."""
        step, attempt, digest = key
        owners, state = self.owners.get(key), self.machine.steps.get(step)
        if owners is None or len(owners) != count or state is None or attempt not in state.inbox:
            return None
        received = state.inbox[attempt].reduced.get(owners[index])  # only the owner's own word for its slice
        return received.tensor if received is not None and received.fits(digest, count, index) else None
