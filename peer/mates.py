"""Stage-mates: the peers that host one stage train as one data-parallel group, step by step.

Each step of the stage is one state machine, run on the peer's event loop (`step_machine`):

    accumulating --(the group holds the target batch, or a mate starts a round)--> averaging
    averaging --(every member agrees on the same contributions, nothing missing)--> stepped
    averaging --(a member died holding samples)--> short --(they are sent again, or --short-wait)--> averaging

Accounting is by identity: every backward is named (trainer, microbatch), and progress,
contributions and state hand-overs carry which microbatches a peer holds. A round has two phases
(`averaging_round`): every member offers the microbatches it holds, then tells the others which
offers it holds; the contributions all hold are summed in slices (`slice_exchange`: each member
sums one slice of every gradient and sends that sum to all), in the order of their peer ids, so all
step on the same bits and no member sends more than about two gradients whatever the stage's size.
What a dead member held is asked for again by id; after `short_wait` seconds the stage steps
without it and counts it as lost, by id.

After a step, mates compare fingerprints of their parameters (carried by progress messages,
`mate_progress`); a replica that differs from the majority takes its mates' state and says so
(`state_handover`). Membership is what a peer sees in the DHT, widened by every peer that sent it
progress or a contribution for the step (`mate_membership`); the mate protocols answer only a peer
whose signed record is on this stage, and refuse anyone else with FORBIDDEN before reading a byte.

`StageMates` composes these parts; each is a module of one job:
- `step_machine`: the phases of each step, and what the parts share (runtime, event loop, P2P);
- `mate_membership`: who the mates are, from the signed records, and who may speak as one;
- `mate_progress`: progress messages, fingerprints, and what the mates hold;
- `averaging_round`: the round's offers and commits, and a leaving peer's hand-over of its gradients;
- `slice_exchange`, `round_slices`: the round's gradients, reduce-scattered then all-gathered;
- `state_handover`: giving the stage's state to a newcomer, and taking a mate's;
- `state_transfer`: the state protocol's two ends, shared with standby holders (`standby`);
- `protocol_handler`: read, answer, reply and hang up, once for every mate protocol;
- `mate_messages`: the checks and bounds on what a mate sends.

This is our own protocol rather than hivemind's Optimizer, for reasons measured on these machines
(2 peers, a 1.2M-parameter model, target batch 32): its progress goes through the DHT and groups
form by matchmaking, so an epoch took 1.0 to 1.5 s against 0.15 to 0.3 s of compute, and shorter
matchmaking times failed to form groups; a failed round stepped on zeroed gradients; and replicas
never held bit-identical parameters, because each applies the all-reduce as a difference to its
own values. Here replicas stay bit-identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

import torch
from hivemind.p2p import P2P, PeerID

from swarm.compression import Codec, get_codec
from swarm.net.allowlist import Handler
from swarm.net.transport import (
    COMMIT_PROTOCOL,
    GRAD_PROTOCOL,
    PROGRESS_PROTOCOL,
    SLICE_PROTOCOL,
    STATE_PROTOCOL,
    get_peer_info,
)
from swarm.peer.averaging_round import AveragingRound
from swarm.peer.faults import FaultPlan
from swarm.peer.mate_membership import MateMembership
from swarm.peer.mate_messages import Held, as_triples
from swarm.peer.mate_progress import ProgressExchange
from swarm.peer.runtime import RoundResult, SampleKey, StageRuntime
from swarm.peer.state_handover import StateHandOver
from swarm.peer.step_machine import StepMachine
from swarm.peer.trainer_departures import watch_departures
from swarm.peer.work_receipts import WorkReceipts
from swarm.proto import PeerInfo
from swarm.records.sample_ledger import SampleLedger, left_record, restore_record, step_record
from swarm.records.stage_records import LEAVING, RECENT_VERSIONS, SERVING, StageRecord

logger = logging.getLogger(__name__)

__all__ = ["StageMates"]

MATE_PROTOCOLS = (PROGRESS_PROTOCOL, GRAD_PROTOCOL, COMMIT_PROTOCOL, STATE_PROTOCOL, SLICE_PROTOCOL)


class StageMates:
    """A peer's view of its stage-mates, the step machine of its stage, and state transfers.

    The runtime's `StepCoordinator`: it tells the mates what this peer holds and runs the rounds.
    """

    def __init__(
        self,
        runtime: StageRuntime,
        peer_id: str,
        model: str,
        averaging_timeout: float = 30.0,
        codec: Codec | None = None,
        short_wait: float = 20.0,
        faults: FaultPlan | None = None,
        ledger: SampleLedger | None = None,
        receipts: WorkReceipts | None = None,
        robust_sum: str = "exact",
    ) -> None:
        self.runtime = runtime
        self.peer_id = peer_id
        self.model = model
        self.stage = runtime.module.stage
        self.averaging_timeout = averaging_timeout
        self.ledger = ledger or SampleLedger(None)
        self.machine = StepMachine(runtime, peer_id, model, faults or FaultPlan())
        self.machine.receipts = receipts
        self.membership = MateMembership(self.machine)
        self.progress = ProgressExchange(self.machine, self.membership)
        self.averaging = AveragingRound(
            self.machine, self.membership, self.progress, averaging_timeout, short_wait, codec or get_codec("none")
        )
        self.averaging.slices.centered = robust_sum == "centered-clip"
        self.averaging.on_fork = self._forked
        self.handover = StateHandOver(self.machine, self.membership, self.progress, self.averaging)
        self.trainers_source: tuple | None = None  # (DHT, run id) where trainers publish, once `watch_departures`
        # (step, parameter fingerprint) of the last steps, announced: holders confirm a copy by two peers' records
        self.recent_versions: deque[tuple[int, str]] = deque(maxlen=RECENT_VERSIONS)

    def watch_departures(self, dht, run_id: str) -> None:
        """From `start` on: reads the trainers' records while a step is short, so that it does not wait for
        trainers that finished (`trainer_departures`)."""
        self.trainers_source = (dht, run_id)

    async def start(self, p2p: P2P, admit: Callable[[Handler, str], Handler] = lambda handler, _: handler) -> None:
        """Registers the mate protocols on the peer's P2P (each through `admit`) and hooks into the runtime."""
        machine = self.machine
        machine.start(p2p)
        if self.trainers_source is not None:

            def news() -> None:  # the trainers' records were read: the short step may end now
                machine.advance(self.runtime.step)

            machine.spawn(watch_departures(machine.departures, machine.waiting_on, news, *self.trainers_source))
        handlers = (
            self.progress.handle,
            self.averaging.handle_contribution,
            self.averaging.handle_commit,
            self.handover.handle,
            self.averaging.slices.handle,
        )
        for protocol, handler in zip(MATE_PROTOCOLS, handlers):
            guarded = self.membership.members_only(handler, protocol)
            await p2p.add_binary_stream_handler(protocol, admit(guarded, protocol))
        self.runtime.coordinator = self

    async def stop(self) -> None:
        """Stops the stage's background work and closes the mate protocols. A round under way goes on: where it
        completes, the mates step on this peer's samples too; where it cannot, they find it serving another
        stage or gone (`round_waiting`) and go on without it."""
        self.machine.cancel_tasks()
        if self.p2p is not None:
            for protocol in MATE_PROTOCOLS:
                with contextlib.suppress(Exception):
                    await self.p2p.remove_binary_stream_handler(protocol)

    # --- the step machine (event loop) ---------------------------------------------------------------

    def phase(self) -> str:
        """The phase of the stage's current step."""
        return self.machine.phase()

    def lost(self) -> Held:
        """While the current step is short: the microbatches it waits for."""
        return self.machine.lost()

    def is_full(self) -> bool:
        """Whether the current step has reached its target batch (or its round has begun): it will step."""
        return self.machine.is_full()

    def update_records(self, records: list[StageRecord]) -> None:
        """Takes in the stage's records from the DHT: who serves, and whether this peer fell behind."""
        new = self.membership.take_records(records)
        if not self.serving:
            return
        step = self.runtime.step
        self.progress.tell(new, step)  # a mate that has just appeared has not heard this peer's progress
        self.machine.check_behind(self.membership.mates)
        self.machine.advance(step)

    def _forked(self, step: int, dead: set[str]) -> None:
        """A round at `step` failed here that the dead owners in `dead` may have completed: if they stepped on it
        before dying, their step differs from the one this peer takes next. The ledger says so as a restore of
        the stage at `step` from this peer's own state, so that their line, if any, counts as an abandoned
        history (its samples rolled back) rather than as a divergent replica."""
        self.ledger.write(restore_record(self.peer_id, self.stage, step, step + 1))
        logger.warning(
            f"Stage {self.stage} step {step}: {sorted(dead)} died holding the round's sums and may have stepped on "
            "it; this peer goes on from its own state (the ledger marks any such step as abandoned)"
        )

    def _abandon_lines_ahead(self, step: int, fingerprint: str) -> None:
        """Before this peer's line of `step`, which leaves it with parameters `fingerprint`: where members stepped
        on it alone (`outran`), mates now gone had stepped past it, or a mate that left the stage had stepped on
        it to other parameters, the ledger marks their steps as a history abandoned (a restore of the stage at
        `step` from this peer's own state), so that their samples count as rolled back, by id, not as silently
        lost, and their step not as divergent. Written first, so that this peer's own line comes after the
        restore and stays in the history that goes on."""
        machine, membership = self.machine, self.membership
        # a mate that left on request hands its un-averaged gradients over, and its steps are this peer's as
        # long as its parameters were: not gone here unless they differ (`forked_leavers`)
        left = {p for p, (_, state) in membership.stage_peers.items() if state == LEAVING}
        gone = machine.left_ahead(step, set(membership.mates) | left)
        forked = membership.forked_leavers(step + 1, fingerprint)
        if not machine.outran.get(step) and not gone and not forked:
            return
        self.ledger.write(restore_record(self.peer_id, self.stage, step, max([step + 1, *gone.values()])))
        if gone:
            logger.warning(
                f"Stage {self.stage} step {step}: {sorted(gone)} had stepped past it without this peer and are gone; "
                "this peer goes on from its own state (the ledger marks their steps as abandoned)"
            )
        if forked:
            logger.warning(
                f"Stage {self.stage} step {step}: {sorted(forked)} stepped on it to other parameters and left the "
                "stage; this peer goes on from its own state (the ledger marks their step as abandoned)"
            )

    def start_serving(self) -> None:
        """Marks this peer as holding the stage's state; it may then start or join rounds."""
        self.serving = True
        self.machine.advance(self.runtime.step)

    def on_step(self, step: int, fingerprint: str) -> None:
        """Called from the runtime thread after every step or state load."""
        while self.recent_versions and self.recent_versions[-1][0] >= step:  # a load back to an earlier step
            self.recent_versions.pop()
        self.recent_versions.append((step, fingerprint))
        result = self.runtime.last_round
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._after_step, step, fingerprint, result)

    def _after_step(self, step: int, fingerprint: str, result: RoundResult | None) -> None:
        machine = self.machine
        self.averaging.departed.clear()
        for old in [s for s in machine.steps if s < step]:
            del machine.steps[old]
        self.progress.reached(step)  # what the mates told of steps ahead of this peer's counts from here
        if result is not None:
            self.progress.remember_summed(frozenset((trainer, mb) for trainer, mb, _ in result.ids))
            self._abandon_lines_ahead(step - 1, fingerprint)
            record = step_record(
                self.peer_id, self.stage, step - 1, result.ids, result.lost, fingerprint, result.seconds
            )
            self.ledger.write(record)
        else:
            machine.forget_behind(step)
        for old in [s for s in machine.outran if s < step]:
            del machine.outran[old]
        for old in [s for s in machine.ahead_of if s < step]:
            del machine.ahead_of[old]
        if self.serving:  # the mates compare fingerprints, and learn this peer has reached the step
            self.progress.tell(set(self.mates) | self.membership.newcomers, step)
            self.progress.compare_fingerprints()
        self.progress.note_holdings()
        if machine.changed is not None:  # a round of an earlier step waiting here is left behind (a state load)
            machine.changed.set()
        machine.wake()
        machine.advance(step)

    def schedule_resync(self, reason: str, source: str | None = None, minimum_step: int | None = None) -> None:
        """Downloads a mate's state in the background, once at a time."""
        self.machine.schedule_resync(reason, source, minimum_step)

    # --- StepCoordinator: called on the runtime thread --------------------------------------------

    def local_progress(self, step: int, held: Held) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.progress.on_local_progress, step, held)

    def average(self, step: int, grad_sum: torch.Tensor | None, held: Held) -> Future:
        """Starts the round of `step` on the event loop; the runtime thread goes on serving meanwhile."""
        rounding = asyncio.wait_for(self.averaging.round(step, grad_sum, held), 3 * self.averaging_timeout + 30)
        return asyncio.run_coroutine_threadsafe(rounding, self.loop)

    def held_elsewhere(self) -> frozenset[SampleKey]:
        """Microbatches another replica holds toward the current step, or a recent step summed (any thread)."""
        return self.progress.held_elsewhere()

    # --- the parts' work, as the peer asks for it ------------------------------------------------------

    async def progress_delivered(self) -> None:
        """Waits (at most a few seconds) until the mates have heard of every sample accumulated so far."""
        await self.progress.delivered()

    async def hand_over(self, timeout: float = 10.0) -> None:
        """Sends this peer's un-averaged gradients to its mates before it leaves, so its samples still count;
        the ledger names what it held, and whether any mate took it."""
        handed = await self.averaging.hand_over(timeout)
        if handed is None:
            return
        step, held, taken = handed
        self.ledger.write(left_record(self.peer_id, self.stage, step, as_triples(held), taken))
        if not taken:
            logger.warning(
                f"Leaving stage {self.stage} with {sum(held.values())} samples of step {step} ({len(held)} "
                "microbatches) that no stage-mate could take: they are given up (named in the ledger)"
            )

    async def another_serves(self, timeout: float = 3.0) -> bool:
        """Whether another peer of this stage answers now that it serves it. Records of peers that died together
        (a wave) outlive them by their TTL, so records alone may show a mate where none lives: a peer about to
        move asks, since the last live peer of a stage that moves only moves the loss."""
        if self.p2p is None or not self.mates:
            return False
        asked = [get_peer_info(self.p2p, PeerID.from_base58(p), timeout) for p in self.mates]
        answers = await asyncio.gather(*asked, return_exceptions=True)
        return any(isinstance(a, PeerInfo) and a.stage == self.stage and a.state == SERVING for a in answers)

    async def download_state(
        self,
        peer_id: str,
        minimum_step: int = 0,
        timeout: float = 120.0,
        check: Callable[[int, str], Awaitable[bool]] | None = None,
    ) -> int:
        """Downloads a mate's state and loads it; returns its step (see `StateHandOver.download_state`)."""
        return await self.handover.download_state(peer_id, minimum_step, timeout, check)

    async def sync_from_mates(self, minimum_step: int = 0, source: str | None = None) -> str | None:
        """Takes a confirmed mate's state (see `StateHandOver.sync_from_mates`); returns whose, or None."""
        return await self.handover.sync_from_mates(minimum_step, source)

    # --- what the peer, its handlers and its metrics read and set -------------------------------------

    @property
    def serving(self) -> bool:
        """Whether this peer holds the stage's state (set by the peer): it may start or join rounds."""
        return self.machine.serving

    @serving.setter
    def serving(self, value: bool) -> None:
        self.machine.serving = value

    @property
    def on_phase(self) -> Callable[[], None] | None:
        """Wakes requests waiting on the step machine (set by the peer)."""
        return self.machine.on_phase

    @on_phase.setter
    def on_phase(self, wake: Callable[[], None] | None) -> None:
        self.machine.on_phase = wake

    @property
    def refresh_records(self) -> Callable[[], Awaitable[None]] | None:
        """Re-reads the stage's records (set by the peer): an unknown sender may have just announced itself."""
        return self.membership.refresh_records

    @refresh_records.setter
    def refresh_records(self, read: Callable[[], Awaitable[None]] | None) -> None:
        self.membership.refresh_records = read

    @property
    def refresh_holders(self) -> Callable[[], Awaitable[None]] | None:
        """Re-reads every stage's records, for standby holders (None: this peer keeps no standby copies)."""
        return self.membership.refresh_holders

    @refresh_holders.setter
    def refresh_holders(self, read: Callable[[], Awaitable[None]] | None) -> None:
        self.membership.refresh_holders = read

    @property
    def standby_holders(self) -> set[str]:
        """Peers of other stages whose records say they hold a standby copy of this one (set by the peer)."""
        return self.membership.standby_holders

    @standby_holders.setter
    def standby_holders(self, holders: set[str]) -> None:
        self.membership.standby_holders = holders

    @property
    def rounds(self) -> int:
        """Averaging rounds this peer took part in."""
        return self.averaging.rounds

    @rounds.setter
    def rounds(self, count: int) -> None:
        self.averaging.rounds = count

    @property
    def p2p(self) -> P2P | None:
        return self.machine.p2p

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self.machine.loop

    @property
    def mates(self) -> dict[str, StageRecord]:
        """The mates the DHT shows serving this stage (less those found unreachable), by peer id."""
        return self.membership.mates

    @property
    def refused_outsiders(self) -> int:
        return self.membership.refused_outsiders

    @property
    def samples_lost(self) -> int:
        return self.averaging.samples_lost

    @property
    def samples_doubled(self) -> int:
        return self.averaging.samples_doubled

    @property
    def dropped_members(self) -> int:
        return self.averaging.dropped_members

    @property
    def clipped_contributions(self) -> int:
        return self.averaging.clipped_contributions

    @property
    def samples_left_out(self) -> int:
        return self.averaging.samples_left_out

    @property
    def failed_rounds(self) -> int:
        return self.averaging.failed_rounds

    @property
    def round_bytes(self) -> tuple[int, int]:
        """Gradient bytes this peer sent and received in averaging rounds."""
        return self.averaging.slices.bytes_sent, self.averaging.slices.bytes_received

    @property
    def divergences(self) -> int:
        return self.progress.divergences

    @property
    def resyncs(self) -> int:
        return self.machine.resyncs

    @property
    def unconfirmed_states(self) -> int:
        return self.handover.unconfirmed_states

    @property
    def standby_bytes_given(self) -> int:
        return self.handover.standby_bytes_given
