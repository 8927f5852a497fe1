"""The step machine of one stage as this peer sees it, and what every part of the stage-mates shares.

Each step of the stage is one state machine, run on the peer's event loop (`StepState`, advanced
only by `StepMachine.advance`):

    accumulating --(the group holds the target batch, or a mate starts a round)--> averaging
    averaging --(every member agrees on the same contributions, nothing missing)--> stepped
    averaging --(a member died holding samples)--> short --(they are sent again, or --short-wait)--> averaging

Besides stepping, a replica may take its mates' state instead (it fell behind, or its parameters
differ from theirs): `schedule_resync` does that in the background, once at a time.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID

from swarm.net.transport import exchange, nothing_listens
from swarm.net.wire import Frame, WireLimits
from swarm.peer.faults import FaultPlan
from swarm.peer.mate_messages import Held, named_ids
from swarm.peer.round_slices import SliceInbox
from swarm.peer.runtime import SampleKey, StageRuntime
from swarm.peer.trainer_departures import TrainerDepartures
from swarm.peer.work_receipts import WorkReceipts
from swarm.proto import MateReply
from swarm.records.stage_records import StageRecord

logger = logging.getLogger(__name__)

ACCUMULATING, AVERAGING, SHORT = "accumulating", "averaging", "short"
SEND_ATTEMPTS = 3  # calls to a mate before it counts as unreachable
# after a resync that found no state, one mate's word that it is ahead starts no other for this long: a
# member that claims a far step in every message would otherwise keep the peer asking its mates for state
CLAIM_PAUSE_S = 5.0


def named_in(box: dict[str, Contribution]) -> set[str]:
    """The senders of the contributions in `box` and every member they name."""
    named = set(box)
    for contribution in box.values():
        named |= contribution.members
    return named


def held_by_the_gone(progress: dict[str, Held], members: set[str], summed) -> Held:
    """What peers outside a round's `members` were heard to hold toward its step, less what it `summed`.

    A mate's progress can reach this peer after the round's offers were made (they carry each member's view
    then): a peer that died holding it would otherwise lose it silently. Kept as expected samples, it goes
    into this peer's next offer, which every member agrees on, so all decide alike whether it is lost."""
    gone = [held for peer, held in progress.items() if peer not in members]
    return {key: n for held in gone for key, n in held.items() if key not in summed}


def handovers_in(box: dict[str, Contribution]) -> set[str]:
    """The members of an attempt's box that left the stage and handed it their gradients: they own no slice,
    commit nothing, and hear no more of the round."""
    return {peer for peer, contribution in box.items() if contribution.handover}


def handed_twice(box: dict[str, Contribution], agreed: set[str]) -> list[str]:
    """The agreed hand-overs that name a microbatch another agreed contribution holds too: its trainer sent it again
    when the round counted the leaver dead, and a member summed it before the hand-over came. Summed, the hand-over
    would count it twice, and its one gradient cannot be split."""
    counts = Counter(key for peer in agreed for key in box[peer].held)
    return sorted(p for p in agreed if box[p].handover and any(counts[key] > 1 for key in box[p].held))


def carry_handovers(box: dict[str, Contribution], next_box: dict[str, Contribution]) -> None:
    """Puts the hand-overs of an attempt that failed into the next attempt: they are good for any attempt. Only
    the hand-overs: a leaving peer's earlier offer, which a member may still hold from an attempt before the
    hand-over, would make it a slice owner that never sends (found in a wave run: a round retried for 60 s)."""
    for peer, contribution in box.items():
        if contribution.handover:  # the last thing a leaving peer sends: it supersedes any offer of its own
            next_box[peer] = contribution


class RoundLeftBehind(Exception):
    """The peer took a mate's state at a later step while a round of an earlier one waited: that round is over
    for it (its gradients were dropped with the load)."""


@dataclass
class Contribution:
    """One member's part of an averaging round."""

    samples: int
    grad_sum: torch.Tensor | None
    members: frozenset[str]
    held: Held = field(default_factory=dict)  # the microbatches summed into grad_sum
    known: Held = field(default_factory=dict)  # every microbatch the member knew someone held at the step
    give_up: bool = False  # the member has waited long enough for lost samples
    norm: float = 0.0  # the L2 norm of grad_sum, as its sender states it (see `round_slices.owner_scales`)
    handover: bool = False  # from a leaving peer: it sent its whole gradient and owns no slice
    holders: dict[SampleKey, frozenset[str]] | None = None  # with a trust root: whom receipts name per microbatch
    dropped: Held = field(default_factory=dict)  # what the member held and dropped to take a state: lost, not held


@dataclass
class StepState:
    """The state machine of one step of the stage, as this peer sees it."""

    phase: str = ACCUMULATING
    attempt: int = 0  # rounds at this step that came up short so far
    view_retries: int = 0  # attempts given up because committers left out a committer (`round_commits`)
    progress: dict[str, Held] = field(default_factory=dict)  # what each member holds toward the step
    mailbox: dict[int, dict[str, Contribution]] = field(default_factory=lambda: defaultdict(dict))  # by attempt
    commits: dict[int, dict[str, frozenset[str]]] = field(default_factory=lambda: defaultdict(dict))  # by attempt
    inbox: dict[int, SliceInbox] = field(default_factory=lambda: defaultdict(SliceInbox))  # slices, by attempt
    lost: Held = field(default_factory=dict)  # while short: what the stage waits for
    # per member (this peer too): what it held and dropped to take a state, and the stage's round expects again
    dropped: dict[str, Held] = field(default_factory=dict)
    short_deadline: float | None = None  # loop time: then the stage steps without what is still lost
    short_ended: str = ""  # why this peer stopped waiting for what was lost (logged once)
    # the mate whose state this peer took at the step: it left this peer out of its own round there, so it may
    # have stepped on the step without this peer (see `AveragingRound._agree`)
    giver: str | None = None

    def known(self) -> Held:
        """Every microbatch a member is known to hold at this step."""
        merged: Held = {}
        for held in self.progress.values():
            merged.update(held)
        return merged


class StepMachine:
    """The stage's steps as this peer sees them, and what the stage-mates' parts share: who this peer is,
    its runtime, the event loop and P2P (from `start`), and their background tasks."""

    def __init__(self, runtime: StageRuntime, peer_id: str, model: str, faults: FaultPlan) -> None:
        self.runtime = runtime
        self.peer_id = peer_id
        self.model = model
        self.stage = runtime.module.stage
        self.num_stages = runtime.module.num_stages
        self.faults = faults
        self.num_parameters = sum(p.numel() for p in runtime.module.parameters())
        state_bytes = 16 * self.num_parameters + 2**20
        self.limits = WireLimits(max_message_bytes=state_bytes, max_tensor_bytes=state_bytes)
        self.steps: dict[int, StepState] = defaultdict(StepState)
        self.serving = False  # set by the peer once it has the stage's state
        self.receipts: WorkReceipts | None = None  # in a swarm with a trust root: what lets work count
        self.p2p: P2P | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.changed: asyncio.Event | None = None  # set when a round under way may have news
        self.on_phase: Callable[[], None] | None = None  # wakes requests waiting on the step machine
        # takes a mate's state at a minimum step (from a given mate, or one confirmed): set by the state hand-over
        self.take_state: Callable[[int, str | None], Awaitable[str | None]] | None = None
        self.stepped_without = -1  # the latest round step a member stepped on without this peer
        self.ahead_of: dict[int, set[str]] = {}  # per step: the members that answered its round from a later step
        # per step: members that stepped on it without this peer and whose state no other mate confirmed; its round
        # goes on without them, and the ledger marks their step abandoned once this peer steps (`StageMates`)
        self.outran: dict[int, set[str]] = {}
        # mates whose records announced a step past this peer's, and the furthest: should they be gone when this
        # peer steps on its own, their later steps are a history it abandons (`left_ahead`)
        self.seen_ahead: dict[str, int] = {}
        self.resyncs = 0
        self.resyncing = False
        self.fruitless_at = -math.inf  # when the last resync ended without a state
        self.behind_checks = 0
        # trainers seen finished: a short step does not wait for what only they could send again
        self.departures = TrainerDepartures()
        # what the stage's last rounds summed (kept by `ProgressExchange`): a short step does not wait for it again
        self.summed_recently: frozenset[SampleKey] = frozenset()
        self._tasks: set[asyncio.Task] = set()

    def start(self, p2p: P2P) -> None:
        """Binds the machine to the peer's P2P and the running event loop."""
        self.p2p = p2p
        self.loop = asyncio.get_running_loop()
        self.changed = asyncio.Event()

    def spawn(self, coroutine) -> asyncio.Task:
        """Runs `coroutine` in the background until it ends or `cancel_tasks`."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def call_mate(
        self, peer_id: str, protocol: str, frames: list[Frame], timeout: float, limits: WireLimits | None = None
    ) -> MateReply | Exception:
        """One call to a mate, tried `SEND_ATTEMPTS` times: its reply, or the last error if none came. A refused
        dial is not tried again: nothing listens at the mate's addresses (a killed peer's port is closed, and
        libp2p answers another dial within its backoff with the same refusal), and each try held the round."""
        for send in range(SEND_ATTEMPTS):
            try:
                target = PeerID.from_base58(peer_id)
                calling = exchange(self.p2p, target, protocol, frames, MateReply, limits or WireLimits())
                reply, _ = await asyncio.wait_for(calling, timeout)
                return reply
            except Exception as e:
                if send + 1 == SEND_ATTEMPTS or nothing_listens(self.p2p, peer_id, e):
                    return e
                await asyncio.sleep(0.2 * (send + 1))
        raise AssertionError("unreachable")

    def check_left_behind(self, step: int) -> None:
        """Raises `RoundLeftBehind` if the runtime moved past `step` during its round, or a member of it refused
        this peer's offer or commit from a later step. A round's own step follows its end, so only a state load
        moves the runtime; waiting on would hold up the next step's round (mates wait for this peer's offer
        there). A member past the step stepped on the round without this peer: stepping on it too would fork."""
        if self.runtime.step > step:
            raise RoundLeftBehind(f"this peer took a state at step {self.runtime.step} meanwhile")
        if self.stepped_without >= step:
            raise RoundLeftBehind("a member stepped on it without this peer; taking the mates' state")

    def mate_stepped_past(self, step: int, mate: str, at: int) -> None:
        """`mate` answered a message of the round of `step` from its later step `at`: see `check_left_behind`.

        A mate that stepped on `step` alone, whose state a resync found no other mate to confirm, is left out of
        the round instead: a newcomer that joined while a lone restorer stepped, say, would otherwise wait for a
        state it may not take for as long as that mate lives (20 s of a wave run, then a fork anyway)."""
        if mate in self.outran.get(step, ()):
            return
        self.ahead_of.setdefault(step, set()).add(mate)
        self.stepped_without = max(self.stepped_without, step)
        self.schedule_resync(f"mate {mate} is already at step {at}")
        if self.changed is not None:
            self.changed.set()

    def sit_out(self, step: int) -> None:
        """The mates summed the round of `step` without this peer, whose offer held nothing (its state came while
        the round was under way): it takes their state after that round rather than step alone or wait."""
        self.stepped_without = max(self.stepped_without, step)
        self.schedule_resync(f"its mates averaged step {step} without it", minimum_step=step + 1)

    def wake(self) -> None:
        """Tells requests waiting on the step machine that it moved."""
        if self.on_phase is not None:
            self.on_phase()

    def own(self, step: int) -> Held:
        """The microbatches this peer holds toward `step`."""
        return dict(self.steps[step].progress.get(self.peer_id, {})) if step in self.steps else {}

    def forget_own(self, step: int, dropped: Held) -> None:
        """This peer no longer holds `dropped` toward `step` or later (a state load dropped them)."""
        for at, state in self.steps.items():
            if at >= step and (own := state.progress.get(self.peer_id)):
                for key in dropped:
                    own.pop(key, None)

    def phase(self) -> str:
        """The phase of the stage's current step."""
        return self.steps[self.runtime.step].phase

    def lost(self) -> Held:
        """While the current step is short: the microbatches it waits for (not those that cannot come: see
        `waits_in_vain`; sent again, they would be answered without accumulating)."""
        step = self.runtime.step
        state = self.steps[step]
        if state.phase != SHORT:
            return {}
        known = state.known()  # those sent again already are not asked for twice
        ahead, summed = self._ahead(step), self.summed_recently
        return {key: n for key, n in state.lost.items() if key not in known and key not in ahead and key not in summed}

    def waiting_on(self) -> set[str]:
        """While the current step is short: the trainers whose lost microbatches it waits for."""
        return {trainer for trainer, _ in self.lost()}

    def waits_in_vain(self, step: int) -> bool:
        """Whether short `step` waits only for microbatches that cannot come: held by a member toward the next step
        (a backward that came while the round was under way: it is summed there, and counted lost here), summed by
        a recent round already (a dead member held a second copy, sent again), or sent by trainers that finished.
        Giving up then costs nothing that waiting would have saved."""
        known, ahead = self.steps[step].known(), self._ahead(step)
        missing = [key for key in self.steps[step].lost if key not in known]

        def cannot_come(key: SampleKey) -> bool:
            return key in ahead or key in self.summed_recently or self.departures.has_finished(key[0])

        return bool(missing) and all(cannot_come(key) for key in missing)

    def gives_up(self, step: int) -> bool:
        """Whether short `step` stops waiting for lost samples: --short-wait is out, or none of them can come."""
        deadline = self.steps[step].short_deadline
        return deadline is not None and (self.loop.time() >= deadline or self.waits_in_vain(step))

    def _ahead(self, step: int) -> Held:
        following = self.steps.get(step + 1)
        return following.known() if following is not None else {}

    def is_full(self) -> bool:
        """Whether the current step has reached its target batch (or its round has begun): it will step."""
        state = self.steps[self.runtime.step]
        if state.phase != ACCUMULATING:
            return True
        return sum(state.known().values()) >= self.runtime.target_batch_size or self.started_by_mate(state)

    def started_by_mate(self, state: StepState) -> bool:
        box = state.mailbox.get(state.attempt, {})
        return any(p != self.peer_id and not c.handover for p, c in box.items())

    def advance(self, step: int) -> None:
        """The one place that decides whether the stage's current step starts (or retries) its round."""
        if step != self.runtime.step or not self.serving or (self.stepped_without >= step and self.resyncing):
            return  # (a member stepped on this step's round without this peer: the mates' state is on its way)
        state = self.steps[step]
        if state.phase == AVERAGING:
            return
        if state.phase == SHORT:
            if why := self._short_ends(step, state):
                if not state.short_ended:
                    state.short_ended = why
                    missing = {key: n for key, n in state.lost.items() if key not in state.known()}
                    logger.info(f"Stage {self.stage} step {step}: {why}; still missing: {named_ids(missing) or 'none'}")
                self.runtime.request_step(step)
            return
        if self.is_full():
            self.runtime.request_step(step)

    def _short_ends(self, step: int, state: StepState) -> str:
        """Why short `step` stops waiting for its lost samples now, or "" while it waits."""
        known = state.known()
        if all(key in known for key in state.lost):
            return "every lost microbatch is held again"
        if self.gives_up(step):
            return "waiting is over (--short-wait, or nothing missing can come)"
        return "a mate started the next attempt" if self.started_by_mate(state) else ""

    def check_behind(self, mates: dict[str, StageRecord]) -> None:
        """Takes the mates' state if their records say this peer fell behind them."""
        step = self.runtime.step
        for peer_id, record in mates.items():
            if record.step > step:
                self.seen_ahead[peer_id] = max(self.seen_ahead.get(peer_id, 0), record.step)
        # one mate's record alone is no proof: where two or more serve, another must be as far ahead
        steps = sorted((r.step for r in mates.values()), reverse=True)
        ahead = (steps[1] if len(steps) >= 2 else steps[0] if steps else step) - step
        # one step ahead for a moment is normal (a mate finishing a round first); longer is not, unless this
        # peer is in that round still (taking a dead owner's sum from a mate, say): it ends, or fails, itself
        in_round = self.steps[step].phase == AVERAGING if step in self.steps else False
        self.behind_checks = self.behind_checks + 1 if ahead >= 1 and not in_round else 0
        if ahead >= 2 or self.behind_checks >= 2:
            self.schedule_resync(f"mates announce step {step + ahead}, this peer is at {step}")

    def left_ahead(self, step: int, mates: set[str]) -> dict[str, int]:
        """This peer stepped on `step` by a round of its own: the mates not in `mates` (gone: dropped as unreachable,
        their records expired) whose records had announced a later step, and that step. They stepped on `step`
        without this peer and died before it could take their state (a lone restorer a newcomer joined, say):
        their steps are a history this peer's abandons, which the ledger must say, or their samples count as
        silently lost and their step as divergent."""
        gone = {p: at for p, at in self.seen_ahead.items() if at > step and p not in mates}
        self.seen_ahead = {p: at for p, at in self.seen_ahead.items() if at > step + 1 and p in mates}
        return gone

    def forget_behind(self, step: int) -> None:
        """This peer reached `step` by a state load: mates announced at or before it are no longer ahead."""
        self.seen_ahead = {p: at for p, at in self.seen_ahead.items() if at > step}

    def claim_ahead(self, mate: str, step: int) -> None:
        """`mate` sent a message of its later `step`: this peer may have missed rounds. One mate's word is no
        proof (the records' check in `check_behind` is), so after a fruitless resync it waits `CLAIM_PAUSE_S`."""
        if self.serving and self.loop.time() - self.fruitless_at >= CLAIM_PAUSE_S:
            self.schedule_resync(f"mate {mate} averages step {step}, this peer is at {self.runtime.step}")

    def schedule_resync(self, reason: str, source: str | None = None, minimum_step: int | None = None) -> None:
        """Downloads a mate's state in the background, once at a time."""
        if self.resyncing or not self.serving:
            return
        self.resyncing = True
        logger.warning(f"Stage {self.stage} takes its mates' state: {reason}")
        wanted = self.runtime.step + 1 if minimum_step is None else minimum_step

        async def resync() -> None:
            took = None
            try:
                took = await self.take_state(wanted, source)
                self.resyncs += took is not None
            finally:
                if took is None:
                    self.fruitless_at = self.loop.time()
                    self._outrun(self.runtime.step)
                self.resyncing = False
                self.behind_checks = 0
                if self.stepped_without >= self.runtime.step:  # no state came: this step's rounds may go on
                    self.advance(self.runtime.step)

        self.spawn(resync())

    def _outrun(self, step: int) -> None:
        """A resync found no confirmed state past `step`: the members that answered its round from a later step
        stepped on it alone, so its round goes on without them (see `mate_stepped_past`)."""
        alone = self.ahead_of.pop(step, set())
        if self.stepped_without < step or not alone:
            return
        self.outran[step] = self.outran.get(step, set()) | alone
        logger.warning(
            f"Stage {self.stage} step {step}: {sorted(alone)} stepped on it without this peer, and no other mate holds "
            "their state; the round goes on without them (the ledger marks their step abandoned)"
        )
