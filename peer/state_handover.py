"""The hand-over of a stage's state between its mates: giving it to a newcomer, and taking a mate's.

A newcomer (or a replica that fell behind or diverged) takes the state of a mate; the giver makes
it a member from the step it takes, and tells it who holds what toward the next step, so that a
death before the round costs exactly the samples the dead held. A peer takes a mate's state only at
a step and fingerprint that another mate confirms, where two or more serve, so one lying mate cannot
take a stage over. Standby holders of this stage (`swarm.peer.standby`) take a copy over the same
protocol and stay out of the stage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial

from swarm.net.wire import pack_frames
from swarm.peer.averaging_round import AveragingRound
from swarm.peer.delta_transfer import answer_deltas
from swarm.peer.mate_membership import MateMembership
from swarm.peer.mate_messages import PROGRESS_TIMEOUT, Held, check_header, ids_to_wire
from swarm.peer.mate_progress import ProgressExchange
from swarm.peer.stage_state import StageStateError, check_state_tensors, state_fingerprint, state_tensors
from swarm.peer.state_transfer import (
    Version,
    confirmed_holders,
    confirmed_versions,
    encode_state,
    load_into_runtime,
    parameters_fingerprint,
    peer_versions,
    request_state,
    state_handler,
    take_holdings,
)
from swarm.peer.step_machine import AVERAGING, StepMachine, StepState
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, HeldSamples, SampleId, StateReply, StateRequest

logger = logging.getLogger(__name__)

CONFIRM_ATTEMPTS = 4  # looks at the mates' (step, fingerprint) before a newcomer gives up on a confirmed state
# seconds a giver waits for the round under way to end before it gives a newcomer the state from before it, and
# how often it looks: given the state after the round, the newcomer is in the next one
ROUND_END_WAIT, ROUND_END_POLL = 2.0, 0.02


def held_samples(progress: dict[str, Held], requester: str) -> list[HeldSamples]:
    """What each member holds toward a step, for a peer taking the state (its own holdings left out)."""
    return [HeldSamples(peer=p, ids=ids_to_wire(held)) for p, held in progress.items() if p != requester and held]


def attempt_to_join(state: StepState, requester: str, member: bool) -> int:
    """The round attempt at the state's step that a member taking it joins: the one under way, unless its offer is
    in that one. That offer names what it drops to load the state, so it joins the next attempt, and a member
    still waiting for its slices of this one sees its offer there and gives this one up rather than wait for
    them until the averaging timeout."""
    return state.attempt + 1 if member and offered_in_round(state, requester) else state.attempt


def offered_in_round(state: StepState, requester: str) -> bool:
    """Whether `requester` offered in the attempt of the round under way at the state's step."""
    return state.phase == AVERAGING and requester in state.mailbox.get(state.attempt, {})


class StateHandOver:
    """Gives this peer's stage state to newcomers and standby holders, and takes a mate's when it must."""

    def __init__(
        self, machine: StepMachine, membership: MateMembership, progress: ProgressExchange, averaging: AveragingRound
    ) -> None:
        self.machine = machine
        self.membership = membership
        self.progress = progress
        self.averaging = averaging
        self.unconfirmed_states = 0  # mates' states not taken: no other mate confirmed their step and fingerprint
        self.standby_bytes_given = 0  # bytes of state sent to standby holders
        self.handle = state_handler(self._answer, failure="Failed to send the stage's state", caller="a stage-mate")
        machine.take_state = self.sync_from_mates

    # --- giving --------------------------------------------------------------------------------------------

    async def _answer(self, requester: str, request: StateRequest, _parts, reply: StateReply) -> list:
        machine, membership = self.machine, self.membership
        if (error := check_header(request, machine.model, machine.stage)) is not None:
            reply.error.CopyFrom(error)
            return [reply]
        if not machine.serving:
            reply.error.CopyFrom(
                Error(code=ErrorCode.UNAVAILABLE, message="this peer is joining and has no state to give")
            )
            return [reply]
        runtime = machine.runtime
        if request.deltas:  # a standby holder catching its copy up
            parameters = sum(p.numel() for p in runtime.module.parameters())
            return await answer_deltas(runtime.deltas, request, runtime.step, parameters, reply)
        member = membership.joins_stage(requester)
        if not member and runtime.deltas is not None:
            runtime.deltas.note_interest()  # a holder's copy taken whole follows by the next steps' deltas
        # it will not contribute to a round under way here: stop waiting for it
        if member and machine.phase() == AVERAGING:
            self.averaging.depart(requester)
            if requester not in membership.mates and not offered_in_round(machine.steps[runtime.step], requester):
                await self._round_ended(runtime.step)
        # a snapshot on the runtime thread sees the state between steps, never mid-step
        snapshot = runtime.run_exclusive(
            lambda: (runtime.step, runtime.samples_stepped, *state_tensors(runtime.module, runtime.optimizer))
        )
        step, samples_stepped, tensors, has_optimizer_state = await asyncio.wrap_future(snapshot)
        if member:
            # the newcomer is a member from the step it takes: rounds from then on include it
            machine.steps[step].progress.setdefault(requester, {})
            if requester not in membership.mates:
                membership.add_newcomer(requester)
            self.averaging.departed.discard(requester)
            # it learns the progress of this peer's mates from here until it shows in the DHT
            self.progress.tell([requester], step)
            logger.info(  # a standby copy goes every few steps: not worth a line each time
                f"Giving stage {machine.stage} state of step {step} (fingerprint {state_fingerprint(tensors)}) "
                f"to {requester}"
            )
        else:
            self.standby_bytes_given += sum(t.numel() * t.element_size() for t in tensors)
        parts = await encode_state(tensors)
        state = machine.steps[step]
        following = machine.steps[step + 1].progress if member and step + 1 in machine.steps else {}
        given = StateReply(
            protocol_version=PROTOCOL_VERSION,
            step=step,
            has_optimizer_state=has_optimizer_state,
            samples_stepped=samples_stepped,
            attempt=attempt_to_join(state, requester, member),
            held=held_samples(state.progress, requester) if member else [],
            held_next=held_samples(following, requester),
            recently_summed=[SampleId(trainer=t, microbatch=mb) for t, mb in self.progress.summed_union],
        )
        return pack_frames(given, parts)

    async def _round_ended(self, step: int) -> None:
        """Waits (at most `ROUND_END_WAIT`) until the round of `step` under way ends. A newcomer given the state
        from before it is out of it, and its first requests wait for a step it does not take: it chased its mates'
        step, found 1-2 record reads later (a trainer's step held 2.1 s in a p3 replay)."""
        machine, loop = self.machine, asyncio.get_running_loop()
        deadline = loop.time() + ROUND_END_WAIT
        while machine.runtime.step == step and machine.phase() == AVERAGING and loop.time() < deadline:
            await asyncio.sleep(ROUND_END_POLL)

    # --- taking --------------------------------------------------------------------------------------------

    async def download_state(
        self,
        peer_id: str,
        minimum_step: int = 0,
        timeout: float = 120.0,
        check: Callable[[int, str], Awaitable[bool]] | None = None,
    ) -> int:
        """Downloads a mate's state and loads it on the runtime thread; returns the step it is at.

        Raises StageStateError if the mate refuses, sends a state that does not fit, is at a step
        before `minimum_step`, or (with `check`) sends a (step, parameter fingerprint) that `check`
        does not confirm.
        """
        machine, membership = self.machine, self.membership
        membership.state_source = peer_id
        try:
            given = await request_state(machine.p2p, peer_id, machine.model, machine.stage, machine.limits, timeout)
            step, tensors, has_optimizer_state = given.step, given.tensors, given.has_optimizer_state
            if step < minimum_step:
                raise StageStateError(f"the mate is at step {step}, not past {minimum_step}")
            runtime = machine.runtime
            check_state_tensors(runtime.module, tensors, has_optimizer_state)
            if check is not None:
                fingerprint = await parameters_fingerprint(runtime.module, tensors)
                if not await check(step, fingerprint):
                    self.unconfirmed_states += 1
                    raise StageStateError(
                        f"no other mate confirms its state (step {step}, fingerprint {fingerprint}); not taken"
                    )
            dropped = await load_into_runtime(runtime, step, tensors, has_optimizer_state, given.samples_stepped)
        finally:
            membership.state_source = None
        logger.info(f"Loaded stage {machine.stage} state of step {step} (fingerprint {state_fingerprint(tensors)})")
        # the giver's view of who holds what toward the next step: should one of them die before the
        # round, this peer knows exactly which samples were lost and asks for them again
        # rounds at this step that the giver found short: the next one is the one this peer joins (its own
        # first round at attempt 0 would wait for mates that moved past it, for the whole averaging timeout)
        state = machine.steps[step]
        state.attempt = max(state.attempt, given.attempt)
        state.giver = peer_id
        take_holdings(machine.steps, step, given, machine.peer_id)
        # the state already sums what the giver's last rounds summed: a trainer may still send one of them
        # here (its reply was lost, or this peer had asked for it as lost before it took this state)
        if given.recently_summed:
            self.progress.remember_summed(given.recently_summed)
        self._ask_again(step, dropped)
        self.progress.reached(step)
        # tell every member this peer is one now, so that each sends it its progress before answering
        # backwards: otherwise this peer could not tell that the stage has its batch and should wait
        members = ({peer_id, *given.held, *membership.mates}) - {machine.peer_id}
        sends = [self.progress.send(mate, step, {}) for mate in members]
        await asyncio.gather(*sends, return_exceptions=True)
        return step

    def _ask_again(self, step: int, dropped: Held) -> None:
        """Makes the stage's round at `step` expect the microbatches whose gradients the load dropped, where the
        state taken does not sum them and no member holds them: the round finds them lost and their trainers send
        them again. Otherwise they would be lost silently: their trainers had their replies, and mates a step
        ahead never heard of them."""
        if not dropped:
            return
        # this peer's own word that it holds them toward `step` (a backward taken during its last round holds
        # toward the next step) went with the load: left in, it would count as a member holding them
        self.machine.forget_own(step, dropped)
        lost = self.progress.expect_lost(step, dropped)
        # the mates hear of them with this peer's progress (sent next): should it die before the round, theirs
        # expects them still; with a trust root, its offers say it dropped them (its receipts name it)
        self.machine.steps[step].dropped.setdefault(self.machine.peer_id, {}).update(lost)
        logger.warning(
            f"Stage {self.machine.stage}: dropped {sum(dropped.values())} accumulated samples to take a mate's state "
            f"at step {step}; {sum(lost.values())} of them will be asked for again"
        )

    async def sync_from_mates(self, minimum_step: int = 0, source: str | None = None) -> str | None:
        """Takes the state of `source`, else of the most advanced mate whose step and fingerprint another
        mate confirms, at `minimum_step` or later; returns the peer id it came from, or None.

        `source` comes from the fingerprints the mates sent in progress (the majority's holder); without
        it, every serving mate is asked its (step, fingerprint), and where two or more answer, only a
        version two of them hold is taken: a mate announcing a step nobody else has cannot take the
        stage over.
        """
        accused = self.membership.accused
        if source is not None and source in accused:
            logger.warning(f"Not taking stage {self.machine.stage} state from {source}: a vouched trainer accused it")
            source = None
        if source is not None:
            candidates = [source]
            check = None
        else:
            candidates = []
            for look in range(CONFIRM_ATTEMPTS):
                versions = await self._mate_versions()
                candidates = [p for p in confirmed_holders(versions, minimum_step) if p not in accused]
                if candidates or not versions:
                    break
                # mates straddling a step boundary: look again once they have all stepped
                await asyncio.sleep(0.5 * (look + 1))
            if not candidates:
                return None

            async def check(step: int, fingerprint: str) -> bool:
                if (step, fingerprint) in confirmed_versions(versions):
                    return True
                # the giver stepped since the mates were asked: ask them again
                return (step, fingerprint) in confirmed_versions(await self._mate_versions())

        stage = self.machine.stage
        for peer_id in candidates:
            try:
                step = await self.download_state(peer_id, minimum_step, check=check)
            except Exception as e:
                logger.warning(f"Could not take stage {stage} state from {peer_id}: {e}")
                continue
            logger.info(f"Took stage {stage} state at step {step} from mate {peer_id}")
            return peer_id
        return None

    async def _mate_versions(self) -> dict[str, Version]:
        """Each serving mate's (step, parameter fingerprint), as it answers now (the silent ones left out)."""
        machine = self.machine
        mates = list(self.membership.mates)
        sources = None
        if (receipts := machine.receipts) is not None:  # only mates vouched trainers gave work to lately count
            initial = machine.runtime.version if machine.runtime.step == 0 else None
            sources = partial(receipts.state_sources, initial=initial)
        return await peer_versions(machine.p2p, mates, machine.model, machine.stage, PROGRESS_TIMEOUT, sources)
