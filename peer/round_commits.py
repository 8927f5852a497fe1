"""The second phase of a stage's averaging round: the members tell each other which offers they hold.

Every member that took part sends the others the contributors it holds (`RoundCommit`); the round sums
the contributions every committer holds. A member that never commits is gone, and what it held is found
lost. A member that did commit but that another committer left out is not gone: the two views of who
belongs to the round differ (one heard of an accusation, or gave up waiting on a slow mate, before the
other). Summing without it would make this peer ask the trainers again for samples a live mate still
holds, and count them twice once that mate is back. So the attempt is given up instead, after a fresh
read of the run's accusations, and the next one starts from views that agree; a committer that lies in
every commit can cost at most `MAX_VIEW_RETRIES` such attempts a step, after which the round takes
what every committer holds, as before. A committer left out whose offer holds nothing the agreed ones lack
(a newcomer that took its state while the round was under way) is no conflict: the round goes on without it,
and it takes the members' state after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from swarm.net.transport import COMMIT_PROTOCOL
from swarm.peer.mate_membership import MateMembership
from swarm.peer.mate_messages import check_header, check_members
from swarm.peer.protocol_handler import protocol_handler
from swarm.peer.round_waiting import RoundWaiting
from swarm.peer.step_machine import Contribution, RoundLeftBehind, StepMachine, StepState, handovers_in
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, MateReply, RoundCommit

logger = logging.getLogger(__name__)

MAX_VIEW_RETRIES = 2  # attempts a step gives up because committers left out a committer
ACCUSATIONS_WAIT = 5.0  # seconds a peer whose mates' views differ waits for a fresh read of the accusations


def offers_nothing(offer: Contribution, agreed: list[Contribution]) -> bool:
    """Whether `offer` holds nothing the `agreed` contributions lack: no samples, no hand-over, nothing dropped or
    given up, and no microbatch it knew to be held that they do not know of."""
    if offer.samples or offer.held or offer.handover or offer.dropped or offer.give_up:
        return False
    known = set().union(*(c.known.keys() | c.held.keys() for c in agreed))
    return offer.known.keys() <= known


class ViewsDiffer(Exception):
    """Committers left out a member that committed: the attempt is given up, not summed without it."""


class RoundCommits:
    """This peer's commits to its stage's rounds, and its answers to its mates' commits."""

    def __init__(
        self,
        machine: StepMachine,
        membership: MateMembership,
        waiting: RoundWaiting,
        averaging_timeout: float,
        offer_again: Callable[[int, int, set[str], set[str]], Callable[[str], None]],
    ) -> None:
        self.machine = machine
        self.membership = membership
        self.waiting = waiting
        self.averaging_timeout = averaging_timeout
        # (step, attempt, members, gone) -> sends this peer's offer of that attempt again to a peer
        self.offer_again = offer_again
        self.handle = protocol_handler(RoundCommit, self._new_reply, self._answer)

    async def agree(self, step: int, attempt: int, state: StepState, view: set[str]) -> set[str] | None:
        """Tells the contributors which contributions this peer holds (`view`); returns those all hold (None:
        a member it waits for moved on to the next attempt, and this peer must follow it). Raises ViewsDiffer
        when a committer left out another committer (see the module's docstring)."""
        machine = self.machine
        loop = asyncio.get_running_loop()
        handovers = handovers_in(state.mailbox[attempt])
        others = view - {machine.peer_id} - handovers
        commits = state.commits[attempt]
        commits[machine.peer_id] = frozenset(view)
        gone: set[str] = set()
        message = RoundCommit(
            protocol_version=PROTOCOL_VERSION,
            model=machine.model,
            stage=machine.stage,
            step=step,
            attempt=attempt,
            contributors=sorted(view),
        )
        for peer_id in others:
            machine.spawn(self._send(peer_id, message, gone))
        offer_again = self.offer_again(step, attempt, view, gone)
        started, probed = loop.time(), {}
        while True:
            machine.changed.clear()
            waiting = others - set(commits) - gone
            machine.check_left_behind(step)
            if state.attempt > attempt or waiting & set(state.mailbox.get(attempt + 1, {})):
                return None
            self.waiting.probe_late(step, waiting, probed, gone, offer_again)
            wait = self.waiting.wait_for(waiting, started) if waiting else 0.0
            if wait <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(machine.changed.wait(), wait)
        machine.check_left_behind(step)
        committed = others & set(commits)
        agreed = set(view) - (others - committed)
        # a hand-over counts only where every committer holds it, as any contribution: a newcomer that joined
        # after a mate left never had it, and would sum without it what the others sum with it
        for peer_id in committed:
            agreed &= commits[peer_id]
        left_out = (committed | {machine.peer_id}) - agreed
        # one that offered nothing the round lacks (a newcomer whose state came while the round was under way)
        # changes no sum and no decision: the round goes on without it rather than giving the attempt up (a
        # retry, a fresh read of the accusations and the members' late notice of it cost a join 2 s)
        box = state.mailbox[attempt]
        empty = {p for p in left_out if offers_nothing(box[p], [box[a] for a in agreed])}
        if machine.peer_id in empty:
            machine.sit_out(step)
            raise RoundLeftBehind("the mates summed it without this peer's offer of nothing; taking their state")
        left_out -= empty
        if left_out and state.view_retries < MAX_VIEW_RETRIES:
            state.view_retries += 1
            await self.membership.read_accusations_now(ACCUSATIONS_WAIT)
            raise ViewsDiffer(f"committers left out {len(left_out)} mate(s) that committed: {sorted(left_out)}")
        if agreed != view:
            logger.warning(
                f"Stage {machine.stage} step {step}: the mates agree on {len(agreed)} of the {len(view)} "
                f"contributions this peer holds; summing those"
            )
        return agreed

    async def _send(self, peer_id: str, message: RoundCommit, gone: set[str]) -> None:
        reply = await self.machine.call_mate(peer_id, COMMIT_PROTOCOL, [message], self.averaging_timeout)
        if isinstance(reply, Exception):
            self.membership.mark_unreachable(peer_id)
        elif reply.error.code == ErrorCode.OK:
            return
        elif reply.error.code == ErrorCode.OUT_OF_SYNC and reply.step > message.step:
            self.machine.mate_stepped_past(message.step, peer_id, reply.step)
        gone.add(peer_id)
        self.machine.changed.set()

    def _new_reply(self) -> MateReply:
        return MateReply(protocol_version=PROTOCOL_VERSION, step=self.machine.runtime.step)

    async def _answer(self, sender: str, message: RoundCommit, _parts, reply: MateReply) -> list:
        machine = self.machine
        self.membership.heard_from(sender)
        error = check_header(message, machine.model, machine.stage) or check_members(message.contributors)
        if error is not None:
            reply.error.CopyFrom(error)
        elif machine.runtime.step <= message.step <= machine.runtime.step + 1:
            state = machine.steps[message.step]
            if not state.attempt <= message.attempt <= state.attempt + 1:  # each attempt kept costs memory
                reply.error.CopyFrom(
                    Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at round attempt {state.attempt}")
                )
            else:
                state.commits[message.attempt][sender] = frozenset(message.contributors)
                machine.changed.set()
        else:
            reply.error.CopyFrom(
                Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at step {machine.runtime.step}")
            )
        return [reply]
