"""Stage-mates: the peers that host one stage train as one data-parallel group, step by step.

Each step of the stage is one state machine, run on the peer's event loop (`StepState`,
advanced only by `StageMates._advance`):

    accumulating --(the group holds the target batch, or a mate starts a round)--> averaging
    averaging --(every member agrees on the same contributions, nothing missing)--> stepped
    averaging --(a member died holding samples)--> short --(they are sent again, or --short-wait)--> averaging

Accounting is by identity: every backward is named (trainer, microbatch), and progress,
contributions and state hand-overs carry which microbatches a peer holds. A round has two phases.
In the first, every member sends its gradient sum, the microbatches in it and every microbatch it
knows a member held (`GradContribution`). In the second, every member tells the others which
contributions it holds (`RoundCommit`); each then sums only the contributions every member holds,
in the order of their peer ids, so all step on the same bits. What the agreed contributions knew
of but do not hold was lost with a dead member: the stage goes short and the trainers are asked
(in the SHORT reply to their next forward) to send those microbatches again. It waits at most
`short_wait` seconds, then steps without them and counts them as lost, by id. Every decision is
taken from the agreed contributions alone, so every member takes the same one.

After a step, mates compare fingerprints of their parameters (carried by progress messages); a
replica that differs from the majority takes its mates' state and says so. Membership is what a
peer sees in the DHT (mates announced as serving), widened by every peer that sent it progress or
a contribution for the step and by the member lists those carry. A mate that cannot be reached is
dropped from the round at once; one that stays silent is dropped when `averaging_timeout` runs out.

Mates are who the signed records say (`swarm.net.identity`): the mate protocols answer only a peer
whose libp2p-authenticated peer id has a record on this stage (joining, serving or leaving), and
refuse anyone else with FORBIDDEN before reading a byte. A peer takes a mate's state only at a
step and fingerprint that another mate confirms, where two or more serve, so one lying mate cannot
take a stage over.

This is our own protocol rather than hivemind's Optimizer, for reasons measured on these machines
(2 peers, a 1.2M-parameter model, target batch 32): its progress goes through the DHT and groups
form by matchmaking, so an epoch took 1.0 to 1.5 s against 0.15 to 0.3 s of compute, and shorter
matchmaking times failed to form groups; a failed round stepped on zeroed gradients; and replicas
never held bit-identical parameters, because each applies the all-reduce as a difference to its
own values. Here a round costs two exchanges and replicas stay bit-identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID

from swarm.compression import Codec, get_codec
from swarm.net.allowlist import Handler
from swarm.net.transport import (
    COMMIT_PROTOCOL,
    GRAD_PROTOCOL,
    PROGRESS_PROTOCOL,
    STATE_PROTOCOL,
    exchange,
    get_peer_info,
)
from swarm.net.wire import (
    WireError,
    WireLimits,
    decode_tensors,
    encode_tensor,
    pack_frames,
    read_frames,
    wait_for_hang_up,
    write_frames,
)
from swarm.peer.contribution_bounds import clip_scales
from swarm.peer.faults import FaultPlan
from swarm.peer.runtime import RoundResult, SampleKey, StageRuntime
from swarm.peer.stage_state import (
    StageStateError,
    check_state_tensors,
    load_state_tensors,
    state_fingerprint,
    state_tensors,
)
from swarm.proto import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    GradContribution,
    HeldSamples,
    MateProgress,
    MateReply,
    PeerInfo,
    RoundCommit,
    SampleId,
    StateReply,
    StateRequest,
)
from swarm.records.sample_ledger import SampleLedger, step_record
from swarm.records.stage_records import LEAVING, PEER_ID, SERVING, StageRecord

logger = logging.getLogger(__name__)

SEND_ATTEMPTS = 3
PROGRESS_TIMEOUT = 5.0
MAX_IDS = 65536  # microbatch ids a mate may name in one message: far above any step's
MAX_MEMBERS = 256  # peers a mate may name as its group in one message: far above any stage's replicas
ABSENT_GRACE = 5.0  # seconds a round waits for a member whose DHT record no longer says it serves
MEMBER_MEMORY = 60.0  # seconds a peer seen with a record on the stage may still speak as a mate without one
REFRESH_INTERVAL = 1.0  # an unknown sender makes the peer re-read its stage's records at most this often
HOLDERS_REFRESH_INTERVAL = 5.0  # an unknown asker for state makes it re-read every stage at most this often
# rounds whose summed microbatch ids a peer remembers: a backward retried on it after another replica's
# step summed it (its reply was lost) is then not summed again; a backward is refused past max_staleness
RECENT_ROUNDS = 8
CONFIRM_ATTEMPTS = 4  # looks at the mates' (step, fingerprint) before a newcomer gives up on a confirmed state

ACCUMULATING, AVERAGING, SHORT = "accumulating", "averaging", "short"

Held = dict[SampleKey, int]  # microbatch id -> samples


def ids_to_wire(held: Held) -> list[SampleId]:
    return [SampleId(trainer=trainer, microbatch=mb, samples=n) for (trainer, mb), n in held.items()]


def ids_from_wire(ids) -> Held:
    return {(i.trainer, int(i.microbatch)): int(i.samples) for i in ids}


@dataclass
class MateState:
    """A stage's state as a mate gave it (`request_state`)."""

    step: int
    tensors: list[torch.Tensor]
    has_optimizer_state: bool
    samples_stepped: int
    held: dict[str, Held]  # the microbatches each other member is known to hold toward the next step
    attempt: int  # rounds at `step` the giver has found short so far
    recently_summed: frozenset[SampleKey]  # what the giver's last rounds summed: the state includes them


def as_triples(held: Held) -> list[tuple[str, int, int]]:
    return [(trainer, mb, n) for (trainer, mb), n in sorted(held.items())]


@dataclass
class Contribution:
    """One member's part of an averaging round."""

    samples: int
    grad_sum: torch.Tensor | None
    members: frozenset[str]
    held: Held = field(default_factory=dict)  # the microbatches summed into grad_sum
    known: Held = field(default_factory=dict)  # every microbatch the member knew someone held at the step
    give_up: bool = False  # the member has waited long enough for lost samples


@dataclass
class StepState:
    """The state machine of one step of the stage, as this peer sees it."""

    phase: str = ACCUMULATING
    attempt: int = 0  # rounds at this step that came up short so far
    progress: dict[str, Held] = field(default_factory=dict)  # what each member holds toward the step
    mailbox: dict[int, dict[str, Contribution]] = field(default_factory=lambda: defaultdict(dict))  # by attempt
    commits: dict[int, dict[str, frozenset[str]]] = field(default_factory=lambda: defaultdict(dict))  # by attempt
    lost: Held = field(default_factory=dict)  # while short: what the stage waits for
    short_deadline: float | None = None  # loop time: then the stage steps without what is still lost

    def known(self) -> Held:
        """Every microbatch a member is known to hold at this step."""
        merged: Held = {}
        for held in self.progress.values():
            merged.update(held)
        return merged


class StageMates:
    """A peer's view of its stage-mates, the step machine of its stage, and state transfers."""

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
    ) -> None:
        self.runtime = runtime
        self.peer_id = peer_id
        self.model = model
        self.stage = runtime.module.stage
        self.num_stages = runtime.module.num_stages
        self.averaging_timeout = averaging_timeout
        self.short_wait = short_wait
        self.codec = codec or get_codec("none")
        self.faults = faults or FaultPlan()
        self.ledger = ledger or SampleLedger(None)
        self.num_parameters = sum(p.numel() for p in runtime.module.parameters())
        state_bytes = 16 * self.num_parameters + 2**20
        self.limits = WireLimits(max_message_bytes=state_bytes, max_tensor_bytes=state_bytes)
        self.mates: dict[str, StageRecord] = {}
        # every peer seen with a signed record on this stage (joining, serving or leaving), when (loop time)
        # and in which state it last was: who may speak as a mate. Remembered a while, so that a record
        # lapsing under load does not shut a live mate out of the round under way.
        self.stage_peers: dict[str, tuple[float, str]] = {}
        self.refresh_records: Callable[[], Awaitable[None]] | None = None  # re-reads the stage's records
        # peers of other stages whose signed records say they hold a standby copy of this stage
        # (`swarm.peer.standby`): they may download its state, and nothing else; kept up to date by the peer
        self.standby_holders: set[str] = set()
        self.standby_bytes_given = 0  # bytes of state sent to standby holders
        # re-reads every stage's records, for standby holders (None: this peer keeps no standby copies)
        self.refresh_holders: Callable[[], Awaitable[None]] | None = None
        self._holders_refresh: asyncio.Task | None = None
        self._holders_refreshed_at = float("-inf")
        self._refreshing: asyncio.Task | None = None
        self._refreshed_at = float("-inf")
        self._refresh_began = float("-inf")
        self.refused_outsiders = 0  # mate messages from peers no record puts on this stage
        self.unconfirmed_states = 0  # mates' states not taken: no other mate confirmed their step and fingerprint
        self.steps: dict[int, StepState] = defaultdict(StepState)
        self.fingerprints: dict[str, tuple[int, str]] = {}  # per mate: its latest (step, fingerprint)
        self.rounds = 0
        self.resyncs = 0
        self.divergences = 0
        self.dropped_members = 0
        self.samples_lost = 0
        self.samples_doubled = 0
        self.clipped_contributions = 0  # mates' gradients scaled down to the group's bound
        self.serving = False  # set by the peer once it has the stage's state
        self.p2p: P2P | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._behind_checks = 0
        self._resyncing = False
        # peers that asked for this peer's state: they will not contribute to the round under way
        self._departed: set[str] = set()
        self._handed_over: set[str] = set()  # mates that left after handing over their gradients
        self.on_phase: Callable[[], None] | None = None  # wakes requests waiting on the step machine
        self._progress_sends: dict[asyncio.Task, str] = {}  # progress on its way, and the mate it goes to
        self._silent: set[str] = set()  # mates the last progress did not reach: not waited for
        # mates a round could not reach, and the expiration of the record they had then: such a mate is
        # left out of rounds until it announces itself again or sends something, so that a dead mate
        # costs one failed round, not one per step until its record expires
        self._unreachable: dict[str, float] = {}
        # peers this peer gave its state to, until they announce themselves serving: they are members
        # from the step they took, and must hear this peer's progress before its backwards are answered
        self._newcomers: set[str] = set()
        self._state_source: str | None = None  # the mate whose state this peer is downloading now
        self._recently_summed: deque[frozenset[SampleKey]] = deque(maxlen=RECENT_ROUNDS)
        self._summed_union: frozenset[SampleKey] = frozenset()  # of _recently_summed, rebuilt once a step
        # read on the runtime thread, replaced whole on the event loop (see held_elsewhere)
        self._elsewhere: frozenset[SampleKey] = frozenset()

    async def start(self, p2p: P2P, admit: Callable[[Handler, str], Handler] = lambda handler, _: handler) -> None:
        """Registers the mate protocols on the peer's P2P (each through `admit`) and hooks into the runtime."""
        self.p2p = p2p
        self.loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        for protocol, handler in (
            (PROGRESS_PROTOCOL, self._handle_progress),
            (GRAD_PROTOCOL, self._handle_contribution),
            (COMMIT_PROTOCOL, self._handle_commit),
            (STATE_PROTOCOL, self._handle_state),
        ):
            await p2p.add_binary_stream_handler(protocol, admit(self._members_only(handler, protocol), protocol))
        self.runtime.coordinator = self

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.p2p is not None:
            for protocol in (PROGRESS_PROTOCOL, GRAD_PROTOCOL, COMMIT_PROTOCOL, STATE_PROTOCOL):
                with contextlib.suppress(Exception):
                    await self.p2p.remove_binary_stream_handler(protocol)

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- the step machine (event loop) ---------------------------------------------------------------

    def phase(self) -> str:
        """The phase of the stage's current step."""
        return self.steps[self.runtime.step].phase

    def lost(self) -> Held:
        """While the current step is short: the microbatches it waits for."""
        state = self.steps[self.runtime.step]
        if state.phase != SHORT:
            return {}
        known = state.known()  # those sent again already are not asked for twice
        return {key: n for key, n in state.lost.items() if key not in known}

    def is_full(self) -> bool:
        """Whether the current step has reached its target batch (or its round has begun): it will step."""
        state = self.steps[self.runtime.step]
        if state.phase != ACCUMULATING:
            return True
        return sum(state.known().values()) >= self.runtime.target_batch_size or self._started_by_mate(state)

    def _started_by_mate(self, state: StepState) -> bool:
        box = state.mailbox.get(state.attempt, {})
        return any(p != self.peer_id and p not in self._handed_over for p in box)

    def _advance(self, step: int) -> None:
        """The one place that decides whether the stage's current step starts (or retries) its round."""
        if step != self.runtime.step or not self.serving:
            return
        state = self.steps[step]
        if state.phase == AVERAGING:
            return
        if state.phase == SHORT:
            known = state.known()
            back = all(key in known for key in state.lost)
            expired = self.loop.time() >= state.short_deadline
            if back or expired or self._started_by_mate(state):
                self.runtime.request_step(step)
            return
        if self.is_full():
            self.runtime.request_step(step)

    def update_records(self, records: list[StageRecord]) -> None:
        """Takes in the stage's records from the DHT: who serves, and whether this peer fell behind."""
        now = self.loop.time() if self.loop is not None else 0.0
        for r in records:
            if r.peer_id != self.peer_id and r.model == self.model and r.num_stages == self.num_stages:
                self.stage_peers[r.peer_id] = (now, r.state)
        for peer_id in [p for p, (seen, _) in self.stage_peers.items() if now - seen > MEMBER_MEMORY]:
            del self.stage_peers[peer_id]
        mates = {
            r.peer_id: r
            for r in records
            if r.peer_id != self.peer_id
            and r.state == SERVING
            and r.model == self.model
            and r.num_stages == self.num_stages
        }
        for peer_id, expiration in list(self._unreachable.items()):
            if peer_id in mates and mates[peer_id].expiration <= expiration:
                del mates[peer_id]  # the record it had when it could not be reached: not a sign of life
            else:
                del self._unreachable[peer_id]  # it announced itself since, or its record is gone
        new = set(mates) - set(self.mates)
        self.mates = mates
        self._newcomers -= set(mates)  # they hear progress as mates from now on
        if not self.serving:
            return
        step = self.runtime.step
        for peer_id in new:  # a mate that has just appeared has not heard this peer's progress
            self._spawn(self._send_progress(peer_id, step, self._own(step)))
        # one mate's record alone is no proof: where two or more serve, another must be as far ahead
        steps = sorted((r.step for r in mates.values()), reverse=True)
        ahead = (steps[1] if len(steps) >= 2 else steps[0] if steps else step) - step
        self._behind_checks = self._behind_checks + 1 if ahead >= 1 else 0
        # one step ahead for a moment is normal (a mate finishing a round first); longer is not
        if ahead >= 2 or self._behind_checks >= 2:
            self.schedule_resync(f"mates announce step {step + ahead}, this peer is at {step}")
        self._advance(step)

    # --- who may speak as a mate ------------------------------------------------------------------------

    def _members_only(self, handler: Handler, protocol: str) -> Handler:
        """`handler` for peers the signed records put on this stage; anyone else is refused unread."""

        async def guarded(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sender = str(stream_info.peer_id)
            standby = protocol == STATE_PROTOCOL and sender in self.standby_holders
            if standby or await self._admits(sender) or (protocol == STATE_PROTOCOL and await self._new_holder(sender)):
                await handler(stream_info, reader, writer)
                return
            self.refused_outsiders += 1
            if self.refused_outsiders in (1, 10, 100) or self.refused_outsiders % 1000 == 0:
                logger.warning(
                    f"Refused {self.refused_outsiders} stage-mate message(s), lately on {protocol} from {sender}: "
                    f"no signed record puts it on stage {self.stage}"
                )
            error = Error(code=ErrorCode.FORBIDDEN, message=f"no signed record puts {sender} on stage {self.stage}")
            if protocol == STATE_PROTOCOL:
                reply = StateReply(protocol_version=PROTOCOL_VERSION, error=error)
            else:
                reply = MateReply(protocol_version=PROTOCOL_VERSION, step=self.runtime.step, error=error)
            await self._reply(reader, writer, [reply])

        return guarded

    def _is_member(self, peer_id: str) -> bool:
        return (
            peer_id in self.stage_peers
            or peer_id in self.mates
            or peer_id in self._newcomers
            or peer_id == self._state_source
        )

    async def _admits(self, peer_id: str) -> bool:
        """Whether `peer_id` has a record on this stage. An unknown one makes the peer re-read the records
        (a newcomer asks for state right after announcing itself): one read at a time, at most every
        `REFRESH_INTERVAL`, shared by every handler waiting, and one that began after the caller arrived."""
        if self._is_member(peer_id):
            return True
        if self.refresh_records is None:
            return False
        arrived = self.loop.time()
        for _ in range(2):
            if self._refreshing is None or self._refreshing.done():
                delay = max(0.0, self._refreshed_at + REFRESH_INTERVAL - self.loop.time())
                self._refreshing = asyncio.ensure_future(self._refresh_once(delay))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._refreshing), PROGRESS_TIMEOUT + REFRESH_INTERVAL)
            if self._is_member(peer_id):
                return True
            if self._refresh_began >= arrived:
                break  # a read that began after the caller arrived did not find it: no record
        return False

    async def _new_holder(self, peer_id: str) -> bool:
        """Whether `peer_id` holds a standby copy of this stage that the last read of every stage did not show (a
        new holder asks for state right after announcing itself): one such read at a time, and at most every
        `HOLDERS_REFRESH_INTERVAL`, so that strangers asking for state cannot make the peer read the DHT at will."""
        if self.refresh_holders is None:
            return False
        if self._holders_refresh is None or self._holders_refresh.done():
            if self.loop.time() < self._holders_refreshed_at + HOLDERS_REFRESH_INTERVAL:
                return False
            self._holders_refreshed_at = self.loop.time()
            self._holders_refresh = asyncio.ensure_future(self.refresh_holders())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._holders_refresh), PROGRESS_TIMEOUT + REFRESH_INTERVAL)
        return peer_id in self.standby_holders

    async def _refresh_once(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._refresh_began = self.loop.time()
        try:
            await self.refresh_records()
        except Exception as e:
            logger.debug(f"Could not re-read stage {self.stage}'s records: {e}")
        finally:
            self._refreshed_at = self.loop.time()

    def _mark_unreachable(self, peer_id: str) -> None:
        """Leaves a mate that could not be reached out of later rounds until it shows a sign of life."""
        record = self.mates.pop(peer_id, None)
        if record is not None:
            self._unreachable[peer_id] = record.expiration
        self._newcomers.discard(peer_id)

    def _heard_from(self, peer_id: str) -> None:
        """A mate sent something: it is reachable (it rejoins the rounds with its next record)."""
        self._unreachable.pop(peer_id, None)

    def _own(self, step: int) -> Held:
        return dict(self.steps[step].progress.get(self.peer_id, {})) if step in self.steps else {}

    def start_serving(self) -> None:
        """Marks this peer as holding the stage's state; it may then start or join rounds."""
        self.serving = True
        self._advance(self.runtime.step)

    def on_step(self, step: int, fingerprint: str) -> None:
        """Called from the runtime thread after every step or state load."""
        result = self.runtime.last_round
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._after_step, step, fingerprint, result)

    def _after_step(self, step: int, fingerprint: str, result: RoundResult | None) -> None:
        self._departed.clear()
        for old in [s for s in self.steps if s < step]:
            del self.steps[old]
        if result is not None:
            self._remember_summed(frozenset((trainer, mb) for trainer, mb, _ in result.ids))
            record = step_record(
                self.peer_id, self.stage, step - 1, result.ids, result.lost, fingerprint, result.seconds
            )
            self.ledger.write(record)
        if self.serving:  # the mates compare fingerprints, and learn this peer has reached the step
            for peer_id in set(self.mates) | self._newcomers:
                self._spawn(self._send_progress(peer_id, step, self._own(step)))
            self._compare_fingerprints()
        self._note_holdings()
        if self.on_phase is not None:
            self.on_phase()
        self._advance(step)

    def _remember_summed(self, keys: frozenset[SampleKey]) -> None:
        """Adds one round's summed microbatches to the last RECENT_ROUNDS', and their union."""
        self._recently_summed.append(keys)
        self._summed_union = frozenset().union(*self._recently_summed)

    def held_elsewhere(self) -> frozenset[SampleKey]:
        """Microbatches another replica holds toward the current step, or a recent step summed (any thread).

        A backward for one of them reached this peer as a retry: its first attempt was applied, but the
        reply never reached the trainer (lost, or late past the trainer's deadline). The runtime answers it
        without summing its gradient again. Should that replica die before the round, its holdings are
        lost by id and their trainers send them again, so skipping costs time at worst, never a sample.
        """
        return self._elsewhere

    def _note_holdings(self) -> None:
        """Rebuilds `held_elsewhere` after what the mates hold, who is silent, or the step changed."""
        state = self.steps.get(self.runtime.step)
        held: set[SampleKey] = set()
        if state is not None:
            for member, keys in state.progress.items():
                # a mate that progress no longer reaches is likely dead: a retry of its microbatches is summed
                # here, so the round need not wait for them (were it alive after all, the round counts them twice)
                if member != self.peer_id and member not in self._silent:
                    held.update(keys)
        self._elsewhere = self._summed_union.union(held)

    # --- StepCoordinator: called on the runtime thread --------------------------------------------

    def local_progress(self, step: int, held: Held) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._on_local_progress, step, held)

    def average(self, step: int, grad_sum: torch.Tensor | None, held: Held) -> RoundResult | None:
        future = asyncio.run_coroutine_threadsafe(self._round(step, grad_sum, held), self.loop)
        return future.result(3 * self.averaging_timeout + 30)

    # --- progress -----------------------------------------------------------------------------------

    def _on_local_progress(self, step: int, held: Held) -> None:
        if step != self.runtime.step:
            return
        state = self.steps[step]
        state.progress[self.peer_id] = held
        # every member hears, also one that took a mate's state and is not in the DHT yet
        for peer_id in (set(self.mates) | set(state.progress) | self._newcomers) - {self.peer_id}:
            task = self._spawn(self._send_progress(peer_id, step, held))
            self._progress_sends[task] = peer_id
            task.add_done_callback(lambda t: self._progress_sends.pop(t, None))
        self._advance(step)

    async def progress_delivered(self) -> None:
        """Waits (at most `PROGRESS_TIMEOUT`) until the mates have heard of every sample accumulated so far.

        A backward is answered only after this: once a trainer holds the reply, the mates know which
        microbatches this peer holds, so should it die before the round they know exactly what was
        lost and ask for it again, instead of waiting for a batch that never fills. Mates the last
        progress did not reach are not waited for, so a dead mate does not slow every backward down.
        """
        pending = [task for task, mate in self._progress_sends.items() if mate not in self._silent]
        if pending:
            await asyncio.wait(pending, timeout=PROGRESS_TIMEOUT)

    async def _send_progress(self, peer_id: str, step: int, held: Held) -> None:
        await self.faults.hit("progress")
        message = MateProgress(
            protocol_version=PROTOCOL_VERSION,
            model=self.model,
            stage=self.stage,
            step=step,
            samples=sum(held.values()),
            held=ids_to_wire(held),
            fingerprint=self.runtime.fingerprint_at(step),
        )
        try:
            await asyncio.wait_for(
                exchange(self.p2p, PeerID.from_base58(peer_id), PROGRESS_PROTOCOL, [message], MateReply, WireLimits()),
                PROGRESS_TIMEOUT,
            )
            if peer_id in self._silent:
                self._silent.discard(peer_id)
                self._note_holdings()
        except Exception as e:  # the round itself tolerates a silent mate
            if peer_id not in self._silent:
                self._silent.add(peer_id)
                self._note_holdings()
            self._newcomers.discard(peer_id)  # one that never came up; a live one speaks for itself
            logger.debug(f"Could not send progress to {peer_id}: {type(e).__name__}: {e}")

    async def _handle_progress(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        reply = MateReply(protocol_version=PROTOCOL_VERSION, step=self.runtime.step)
        try:
            message, _ = await read_frames(reader, MateProgress, WireLimits())
            sender = str(stream_info.peer_id)
            self._heard_from(sender)
            if (error := self._check_header(message) or self._check_ids(message.held)) is not None:
                reply.error.CopyFrom(error)
            elif message.step >= self.runtime.step:  # older progress no longer matters
                # within a step a peer's holdings only grow, and progress messages may arrive out of order:
                # an older, shorter one must not make this peer forget microbatches the sender holds
                self.steps[message.step].progress.setdefault(sender, {}).update(ids_from_wire(message.held))
                self._note_holdings()
                if message.fingerprint:
                    self.fingerprints[sender] = (message.step, message.fingerprint)
                    self._compare_fingerprints()
                self._advance(message.step)
        except WireError as e:
            reply.error.CopyFrom(Error(code=e.code, message=str(e)))
        await self._reply(reader, writer, [reply])

    def _compare_fingerprints(self) -> None:
        """A replica whose parameters differ from most of its mates' at the same step takes their state."""
        step, mine = self.runtime.version
        if not self.serving or self._resyncing or self.steps[step].phase != ACCUMULATING:
            return
        table = {p: fp for p, (s, fp) in self.fingerprints.items() if s == step and p in self.mates}
        if not table:
            return
        table[self.peer_id] = mine
        counts = Counter(table.values())
        # the most common fingerprint; on a tie, the one the smallest peer id holds
        majority = min(counts, key=lambda fp: (-counts[fp], min(p for p, f in table.items() if f == fp)))
        if majority == mine:
            return
        holders = sorted(p for p, fp in table.items() if fp == majority)
        self.divergences += 1
        logger.warning(
            f"Stage {self.stage} step {step}: this replica's parameters ({mine}) differ from "
            f"{counts[majority]} of {len(table)} replicas' ({majority}); taking the state of {holders[0]}"
        )
        self.schedule_resync("its parameters differ from its mates'", source=holders[0], minimum_step=step)

    def _check_ids(self, *id_lists) -> Error | None:
        """A remote's microbatch ids are bounded before they cost memory or count as samples."""
        for ids in id_lists:
            if len(ids) > MAX_IDS:
                return Error(code=ErrorCode.BAD_REQUEST, message=f"more than {MAX_IDS} microbatch ids")
            if any(not 0 < i.samples <= self.runtime.max_batch_samples for i in ids):
                return Error(code=ErrorCode.BAD_REQUEST, message="a microbatch id with an impossible sample count")
        return None

    @staticmethod
    def _check_members(members) -> Error | None:
        """A remote's list of peers is bounded and holds peer ids only: each one would cost a send."""
        if len(members) > MAX_MEMBERS:
            return Error(code=ErrorCode.BAD_REQUEST, message=f"more than {MAX_MEMBERS} members named")
        if not all(PEER_ID.fullmatch(member) for member in members):
            return Error(code=ErrorCode.BAD_REQUEST, message="a member that is no peer id")
        return None

    def _check_header(self, message) -> Error | None:
        if message.protocol_version != PROTOCOL_VERSION:
            return Error(code=ErrorCode.VERSION_MISMATCH, message=f"this peer speaks protocol {PROTOCOL_VERSION}")
        if message.model != self.model or message.stage != self.stage:
            return Error(code=ErrorCode.WRONG_STAGE, message=f"this peer hosts stage {self.stage} of {self.model}")
        return None

    @staticmethod
    async def _reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: list) -> None:
        try:
            await write_frames(writer, frames)
            await wait_for_hang_up(reader)
        except Exception as e:
            logger.debug(f"Could not answer a stage-mate: {type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    # --- averaging rounds ------------------------------------------------------------------------------

    async def _round(self, step: int, grad_sum: torch.Tensor | None, held: Held) -> RoundResult | None:
        """This peer's side of the averaging round at `step`: what the group agreed to step on, or None."""
        state = self.steps[step]
        state.phase = AVERAGING
        started = self.loop.time()
        try:
            result = await self._agree(step, state, grad_sum, held)
            if result is not None:
                result.seconds = self.loop.time() - started
            return result
        finally:
            if state.phase == AVERAGING:
                state.phase = ACCUMULATING
            if self.on_phase is not None:
                self.on_phase()
            self.loop.call_soon(self._advance, step)

    async def _agree(self, step: int, state: StepState, grad_sum: torch.Tensor | None, held: Held):
        attempt = state.attempt
        give_up = state.short_deadline is not None and self.loop.time() >= state.short_deadline
        state.progress[self.peer_id] = held
        box = state.mailbox[attempt]
        members = {self.peer_id, *self.mates, *state.progress} | self._named_in(box)
        # what the stage already waits for stays expected: a give-up round must count it as lost
        known = {**state.lost, **state.known()}
        own = Contribution(sum(held.values()), grad_sum, frozenset(members), held, known, give_up)
        box[self.peer_id] = own
        await self.faults.hit("before_contribution")
        await self._gather(step, attempt, box, members, own)
        await self.faults.hit("after_contribution")
        agreed = await self._commit(step, attempt, state, set(box))
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
        if lost and not any(c.give_up for c in contributions):
            self._go_short(step, state, attempt, agreed, box, lost)
            return None
        total, grad = 0, None
        ids: list[tuple[str, int, int]] = []
        scales = self._clip_scales(step, sorted(agreed), contributions)
        for contribution, scale in zip(contributions, scales):
            total += contribution.samples
            ids += as_triples(contribution.held)
            if contribution.grad_sum is not None:
                part = contribution.grad_sum if scale == 1.0 else contribution.grad_sum * scale
                grad = part.clone() if grad is None else grad.add_(part)
        doubled = sum(expected.get(key, 0) * (count - 1) for key, count in summed.items() if count > 1)
        if doubled:
            self.samples_doubled += doubled
            logger.warning(
                f"Stage {self.stage} step {step}: {doubled} samples were held by two mates and count twice "
                f"(microbatches {sorted(mb for (_, mb), c in summed.items() if c > 1)})"
            )
        if lost:
            self.samples_lost += sum(lost.values())
            logger.warning(
                f"Stage {self.stage} step {step}: stepping without {sum(lost.values())} lost samples "
                f"({len(lost)} microbatches: their holder died and they were not sent again within "
                f"{self.short_wait:.0f}s)"
            )
        if len(contributions) > 1:
            logger.debug(f"Stage {self.stage} step {step}: averaged {total} samples over {len(contributions)} peers")
        return RoundResult(grad, total, ids, as_triples(lost))

    def _clip_scales(self, step: int, senders: list[str], contributions: list[Contribution]) -> list[float]:
        """Per contribution, the share of its gradient the round takes (see `contribution_bounds`)."""
        measured = [i for i, c in enumerate(contributions) if c.grad_sum is not None and c.samples > 0]
        norms = [float(contributions[i].grad_sum.norm()) / contributions[i].samples for i in measured]
        scales = [1.0] * len(contributions)
        for i, scale in zip(measured, clip_scales(norms)):
            scales[i] = scale
            if scale < 1.0:
                self.clipped_contributions += 1
                logger.warning(
                    f"Stage {self.stage} step {step}: the gradient of {senders[i]} is {1 / scale:.3g} times the "
                    f"group's bound; scaled down to it ({self.clipped_contributions} clipped so far)"
                )
        return scales

    def _go_short(
        self, step: int, state: StepState, attempt: int, agreed: set[str], box: dict[str, Contribution], lost: Held
    ) -> None:
        """The round found samples missing: wait (bounded) for the trainers to send them again."""
        state.phase = SHORT
        state.lost = lost
        state.attempt = attempt + 1
        # members outside the agreed set are gone: what they held is exactly what is lost
        for peer_id in [p for p in state.progress if p not in agreed and p != self.peer_id]:
            del state.progress[peer_id]
        self._note_holdings()
        # what leaving mates handed over is still good: it goes into the next attempt as it is
        for peer_id in self._handed_over & set(box):
            state.mailbox[attempt + 1][peer_id] = box[peer_id]
        if state.short_deadline is None:
            state.short_deadline = self.loop.time() + self.short_wait
            self.loop.call_later(self.short_wait + 0.01, self._advance, step)
        logger.warning(
            f"Stage {self.stage} step {step}: a mate died holding {sum(lost.values())} samples ({len(lost)} "
            f"microbatches); waiting up to {state.short_deadline - self.loop.time():.0f}s for their trainers to "
            "send them again"
        )

    async def _gather(
        self, step: int, attempt: int, box: dict[str, Contribution], members: set[str], own: Contribution
    ) -> None:
        loop = asyncio.get_running_loop()
        unreachable: set[str] = set()
        sent = {self.peer_id}
        started = loop.time()
        while True:
            for peer_id in members - sent:
                sent.add(peer_id)
                self._spawn(self._send_contribution(peer_id, step, own, members, unreachable, attempt=attempt))
            self._changed.clear()
            members |= self._named_in(box)
            missing = members - set(box) - unreachable - self._departed
            if not missing and not (members - sent):
                return
            wait = self._wait_for(missing, started)
            if wait <= 0:
                self.dropped_members += len(missing)
                logger.warning(
                    f"Stage {self.stage} step {step}: no gradients from {len(missing)} mate(s) within "
                    f"{loop.time() - started:.0f}s; averaging without them"
                )
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)

    def _wait_for(self, missing: set[str], started: float) -> float:
        """Seconds a round still waits for `missing` members (0: no longer).

        A member that no longer announces itself serving is given `ABSENT_GRACE` seconds, one that does
        the whole `averaging_timeout`: a peer that has just died can leave a connection that hangs
        rather than fails, and its expired record says it is gone long before the timeout would.
        """
        now = self.loop.time()
        limit = self.averaging_timeout if missing & set(self.mates) else min(ABSENT_GRACE, self.averaging_timeout)
        remaining = started + limit - now
        # wake up at least every second: the DHT view may drop the member meanwhile
        return 0.0 if remaining <= 0 else max(0.01, min(remaining, 1.0))

    async def _commit(self, step: int, attempt: int, state: StepState, view: set[str]) -> set[str]:
        """Second phase: tells the contributors which contributions this peer holds; returns those all hold."""
        loop = asyncio.get_running_loop()
        others = view - {self.peer_id} - self._handed_over
        commits = state.commits[attempt]
        commits[self.peer_id] = frozenset(view)
        gone: set[str] = set()
        message = RoundCommit(
            protocol_version=PROTOCOL_VERSION,
            model=self.model,
            stage=self.stage,
            step=step,
            attempt=attempt,
            contributors=sorted(view),
        )
        for peer_id in others:
            self._spawn(self._send_commit(peer_id, message, gone))
        started = loop.time()
        while True:
            self._changed.clear()
            waiting = others - set(commits) - gone
            wait = self._wait_for(waiting, started) if waiting else 0.0
            if wait <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)
        agreed = set(view) - (others - set(commits))
        for peer_id in others & set(commits):
            agreed &= commits[peer_id] | self._handed_over
        if agreed != view:
            logger.warning(
                f"Stage {self.stage} step {step}: the mates agree on {len(agreed)} of the {len(view)} contributions "
                f"this peer holds; summing those"
            )
        return agreed

    async def _send_commit(self, peer_id: str, message: RoundCommit, gone: set[str]) -> None:
        for attempt in range(SEND_ATTEMPTS):
            try:
                exchanging = exchange(
                    self.p2p, PeerID.from_base58(peer_id), COMMIT_PROTOCOL, [message], MateReply, WireLimits()
                )
                reply, _ = await asyncio.wait_for(exchanging, self.averaging_timeout)
                if reply.error.code == ErrorCode.OK:
                    return
                break
            except Exception:
                await asyncio.sleep(0.2 * (attempt + 1))
        else:
            self._mark_unreachable(peer_id)
        gone.add(peer_id)
        self._changed.set()

    async def _handle_commit(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        reply = MateReply(protocol_version=PROTOCOL_VERSION, step=self.runtime.step)
        try:
            message, _ = await read_frames(reader, RoundCommit, WireLimits())
            self._heard_from(str(stream_info.peer_id))
            if (error := self._check_header(message) or self._check_members(message.contributors)) is not None:
                reply.error.CopyFrom(error)
            elif self.runtime.step <= message.step <= self.runtime.step + 1:
                state = self.steps[message.step]
                if not state.attempt <= message.attempt <= state.attempt + 1:  # each attempt kept costs memory
                    reply.error.CopyFrom(
                        Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at round attempt {state.attempt}")
                    )
                else:
                    state.commits[message.attempt][str(stream_info.peer_id)] = frozenset(message.contributors)
                    self._changed.set()
            else:
                reply.error.CopyFrom(
                    Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at step {self.runtime.step}")
                )
        except WireError as e:
            reply.error.CopyFrom(Error(code=e.code, message=str(e)))
        await self._reply(reader, writer, [reply])

    @staticmethod
    def _named_in(box: dict[str, Contribution]) -> set[str]:
        named = set(box)
        for contribution in box.values():
            named |= contribution.members
        return named

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
        header = GradContribution(
            protocol_version=PROTOCOL_VERSION,
            model=self.model,
            stage=self.stage,
            step=step,
            samples=own.samples,
            members=sorted(members),
            handover=handover,
            attempt=attempt,
            held=ids_to_wire(own.held),
            known=ids_to_wire(own.known),
            give_up=own.give_up,
        )
        loop = asyncio.get_running_loop()
        parts = []
        if own.grad_sum is not None:
            parts = await loop.run_in_executor(None, encode_tensor, own.grad_sum, self.codec)
        frames = pack_frames(header, parts)
        for send in range(SEND_ATTEMPTS):
            try:
                reply, _ = await asyncio.wait_for(
                    exchange(self.p2p, PeerID.from_base58(peer_id), GRAD_PROTOCOL, frames, MateReply, WireLimits()),
                    self.averaging_timeout,
                )
            except Exception as e:
                if send + 1 < SEND_ATTEMPTS:
                    await asyncio.sleep(0.2 * (send + 1))
                    continue
                logger.warning(f"Stage {self.stage} step {step}: mate {peer_id} is unreachable ({e}); dropping it")
                self._mark_unreachable(peer_id)
                break
            if reply.error.code == ErrorCode.OK:
                return
            if reply.error.code == ErrorCode.OUT_OF_SYNC and reply.step > step:
                self.schedule_resync(f"mate {peer_id} is already at step {reply.step}")
            logger.warning(f"Stage {self.stage} step {step}: mate {peer_id} refused gradients: {reply.error.message}")
            break
        unreachable.add(peer_id)
        self._changed.set()

    async def _handle_contribution(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        sender = str(stream_info.peer_id)
        reply = MateReply(protocol_version=PROTOCOL_VERSION, step=self.runtime.step)
        try:
            header, parts = await read_frames(reader, GradContribution, self.limits)
            self._heard_from(sender)
            reply.error.CopyFrom(await self._accept_contribution(sender, header, parts))
        except WireError as e:
            reply.error.CopyFrom(Error(code=e.code, message=str(e)))
        except Exception as e:
            logger.exception(f"Failed to take gradients from {sender}")
            reply.error.CopyFrom(Error(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}"))
        await self._reply(reader, writer, [reply])

    async def _accept_contribution(self, sender: str, header: GradContribution, parts: list) -> Error:
        error = self._check_header(header) or self._check_ids(header.held, header.known)
        if (error := error or self._check_members(header.members)) is not None:
            return error
        if header.samples != sum(i.samples for i in header.held):
            # the count is what the round steps on: it must be the microbatches named, not a number sent
            return Error(code=ErrorCode.BAD_REQUEST, message="samples do not add up to the microbatches held")
        step = self.runtime.step
        # a peer that has just loaded a mate's state takes part in rounds before it serves; while it loads,
        # the round its source holds at the step it hands over waits for it: refusing would split the group
        loading = sender == self._state_source and header.step >= step
        if not (step <= header.step <= step + 1 or loading):
            if self.serving and header.step > step:
                self.schedule_resync(f"mate {sender} averages step {header.step}, this peer is at {step}")
            return Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at step {step}, not {header.step}")
        grad_sum = None
        if header.samples > 0:
            tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, self.limits)
            if len(tensors) != 1 or tensors[0].shape != (self.num_parameters,) or tensors[0].dtype != torch.float32:
                return Error(code=ErrorCode.BAD_REQUEST, message=f"expected one float32[{self.num_parameters}]")
            if not torch.isfinite(tensors[0]).all():
                return Error(code=ErrorCode.BAD_REQUEST, message="gradients hold NaN or infinity")
            grad_sum = tensors[0]
        state = self.steps[header.step]
        if loading:
            state.attempt = max(state.attempt, header.attempt)  # the source's rounds so far at that step
        if header.attempt < state.attempt:
            return Error(code=ErrorCode.OK)  # from a round already found short here: superseded
        if header.attempt > state.attempt + 1:
            return Error(code=ErrorCode.OUT_OF_SYNC, message=f"this peer is at round attempt {state.attempt}")
        if header.attempt == state.attempt + 1 and state.phase != AVERAGING:
            # the mates retry a round this peer missed (it joined since, or heard of the loss later): join it
            state.attempt = header.attempt
        state.mailbox[header.attempt][sender] = Contribution(
            header.samples,
            grad_sum,
            frozenset(header.members),
            ids_from_wire(header.held),
            ids_from_wire(header.known),
            header.give_up,
        )
        self._changed.set()
        if header.handover:  # a leaving peer's gradients wait for the round the stage would hold anyway
            self._handed_over.add(sender)
        else:
            self._advance(header.step)
        return Error(code=ErrorCode.OK)

    async def hand_over(self, timeout: float = 10.0) -> None:
        """Sends this peer's un-averaged gradients to its mates before it leaves, so its samples still count."""
        if not self.serving or not self.mates:
            return
        self.serving = False  # no new rounds and no resyncs from here on
        runtime = self.runtime
        step, grad_sum, held = await asyncio.wrap_future(
            runtime.run_exclusive(lambda: (runtime.step, runtime.flat_gradient(), dict(runtime.held)))
        )
        if not held:
            return
        members = {self.peer_id, *self.mates}
        state = self.steps[step]
        own = Contribution(sum(held.values()), grad_sum, frozenset(members), held, state.known())
        unreachable: set[str] = set()
        sends = [
            self._send_contribution(p, step, own, members, unreachable, handover=True, attempt=state.attempt)
            for p in self.mates
        ]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), timeout)
        taken = len(self.mates) - len(unreachable)
        logger.info(f"Handed {own.samples} samples of step {step} to {taken} of {len(self.mates)} stage-mate(s)")

    # --- state transfer --------------------------------------------------------------------------------

    async def _handle_state(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        frames: list = []
        try:
            request, _ = await read_frames(reader, StateRequest, WireLimits())
            if (error := self._check_header(request)) is not None:
                frames = [StateReply(protocol_version=PROTOCOL_VERSION, error=error)]
            elif not self.serving:
                error = Error(code=ErrorCode.UNAVAILABLE, message="this peer is joining and has no state to give")
                frames = [StateReply(protocol_version=PROTOCOL_VERSION, error=error)]
            else:
                runtime = self.runtime
                requester = str(stream_info.peer_id)
                # a standby holder takes a copy and stays out of the stage: no round waits for it. So does a
                # peer that left this stage for another (its last record here says LEAVING): it is a holder
                # there, which this peer learns only at its next read of every stage
                left = self.stage_peers.get(requester, (0.0, ""))[1] == LEAVING and requester not in self.mates
                member = not (left or (requester in self.standby_holders and not self._is_member(requester)))
                # a snapshot on the runtime thread sees the state between steps, never mid-step
                # it will not contribute to a round under way here: stop waiting for it
                if member and self.phase() == AVERAGING:
                    self._departed.add(requester)
                    self._changed.set()
                snapshot = runtime.run_exclusive(
                    lambda: (runtime.step, runtime.samples_stepped, *state_tensors(runtime.module, runtime.optimizer))
                )
                step, samples_stepped, tensors, has_optimizer_state = await asyncio.wrap_future(snapshot)
                if member:
                    # the newcomer is a member from the step it takes: rounds from then on include it
                    self.steps[step].progress.setdefault(requester, {})
                    if requester not in self.mates:
                        self._newcomers.add(requester)
                    self._departed.discard(requester)
                    # it learns the progress of this peer's mates from here until it shows in the DHT
                    self._spawn(self._send_progress(requester, step, self._own(step)))
                else:
                    self.standby_bytes_given += sum(t.numel() * t.element_size() for t in tensors)
                if member:  # a standby copy goes every few steps: not worth a line each time
                    logger.info(
                        f"Giving stage {self.stage} state of step {step} (fingerprint {state_fingerprint(tensors)}) "
                        f"to {requester}"
                    )
                parts = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: [p for t in tensors for p in encode_tensor(t, get_codec("none"))]
                )
                reply = StateReply(
                    protocol_version=PROTOCOL_VERSION,
                    step=step,
                    has_optimizer_state=has_optimizer_state,
                    samples_stepped=samples_stepped,
                    attempt=self.steps[step].attempt,
                    held=[
                        HeldSamples(peer=p, ids=ids_to_wire(held))
                        for p, held in self.steps[step].progress.items()
                        if member and p != requester and held
                    ],
                    recently_summed=[SampleId(trainer=t, microbatch=mb) for t, mb in self._summed_union],
                )
                frames = pack_frames(reply, parts)
        except WireError as e:
            frames = [StateReply(protocol_version=PROTOCOL_VERSION, error=Error(code=e.code, message=str(e)))]
        except Exception as e:
            logger.exception("Failed to send the stage's state")
            error = Error(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")
            frames = [StateReply(protocol_version=PROTOCOL_VERSION, error=error)]
        await self._reply(reader, writer, frames)

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
        self._state_source = peer_id
        try:
            given = await request_state(self.p2p, peer_id, self.model, self.stage, self.limits, timeout)
            step, tensors, has_optimizer_state = given.step, given.tensors, given.has_optimizer_state
            if step < minimum_step:
                raise StageStateError(f"the mate is at step {step}, not past {minimum_step}")
            runtime = self.runtime
            check_state_tensors(runtime.module, tensors, has_optimizer_state)
            if check is not None:
                count = sum(1 for _ in runtime.module.parameters())
                fingerprint = await asyncio.get_running_loop().run_in_executor(None, state_fingerprint, tensors[:count])
                if not await check(step, fingerprint):
                    self.unconfirmed_states += 1
                    raise StageStateError(
                        f"no other mate confirms its state (step {step}, fingerprint {fingerprint}); not taken"
                    )

            def apply() -> None:
                load_state_tensors(runtime.module, runtime.optimizer, tensors, has_optimizer_state)

            await asyncio.wrap_future(
                runtime.run_exclusive(lambda: runtime.load_state(step, apply, given.samples_stepped), front=True)
            )
        finally:
            self._state_source = None
        logger.info(f"Loaded stage {self.stage} state of step {step} (fingerprint {state_fingerprint(tensors)})")
        # the giver's view of who holds what toward the next step: should one of them die before the
        # round, this peer knows exactly which samples were lost and asks for them again
        # rounds at this step that the giver found short: the next one is the one this peer joins (its own
        # first round at attempt 0 would wait for mates that moved past it, for the whole averaging timeout)
        state = self.steps[step]
        state.attempt = max(state.attempt, given.attempt)
        progress = state.progress
        for mate, ids in given.held.items():
            if mate != self.peer_id:
                progress.setdefault(mate, {}).update(ids)
        # the state already sums what the giver's last rounds summed: a trainer may still send one of them
        # here (its reply was lost, or this peer had asked for it as lost before it took this state)
        if given.recently_summed:
            self._remember_summed(given.recently_summed)
        self._note_holdings()
        # tell every member this peer is one now, so that each sends it its progress before answering
        # backwards: otherwise this peer could not tell that the stage has its batch and should wait
        members = ({peer_id, *given.held, *self.mates}) - {self.peer_id}
        sends = [self._send_progress(mate, step, {}) for mate in members]
        await asyncio.gather(*sends, return_exceptions=True)
        return step

    async def sync_from_mates(self, minimum_step: int = 0, source: str | None = None) -> str | None:
        """Takes the state of `source`, else of the most advanced mate whose step and fingerprint another
        mate confirms, at `minimum_step` or later; returns the peer id it came from, or None.

        `source` comes from the fingerprints the mates sent in progress (the majority's holder); without
        it, every serving mate is asked its (step, fingerprint), and where two or more answer, only a
        version two of them hold is taken: a mate announcing a step nobody else has cannot take the
        stage over.
        """
        if source is not None:
            candidates = [source]
            check = None
        else:
            candidates = []
            for look in range(CONFIRM_ATTEMPTS):
                versions = await self._mate_versions()
                candidates = confirmed_holders(versions, minimum_step)
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

        for peer_id in candidates:
            try:
                step = await self.download_state(peer_id, minimum_step, check=check)
            except Exception as e:
                logger.warning(f"Could not take stage {self.stage} state from {peer_id}: {e}")
                continue
            logger.info(f"Took stage {self.stage} state at step {step} from mate {peer_id}")
            return peer_id
        return None

    async def _mate_versions(self) -> dict[str, tuple[int, str]]:
        """Each serving mate's (step, parameter fingerprint), as it answers now (the silent ones left out)."""
        mates = list(self.mates)
        infos = await asyncio.gather(
            *(get_peer_info(self.p2p, PeerID.from_base58(p), timeout=PROGRESS_TIMEOUT) for p in mates),
            return_exceptions=True,
        )
        versions = {}
        for peer_id, info in zip(mates, infos):
            if (
                isinstance(info, PeerInfo)
                and info.model == self.model
                and info.stage == self.stage
                and info.state == SERVING
                and info.fingerprint
            ):
                versions[peer_id] = (int(info.step), info.fingerprint)
        return versions

    def schedule_resync(self, reason: str, source: str | None = None, minimum_step: int | None = None) -> None:
        """Downloads a mate's state in the background, once at a time."""
        if self._resyncing or not self.serving:
            return
        self._resyncing = True
        logger.warning(f"Stage {self.stage} takes its mates' state: {reason}")
        wanted = self.runtime.step + 1 if minimum_step is None else minimum_step

        async def resync() -> None:
            try:
                if await self.sync_from_mates(wanted, source) is not None:
                    self.resyncs += 1
            finally:
                self._resyncing = False
                self._behind_checks = 0

        self._spawn(resync())


async def request_state(
    p2p: P2P, peer_id: str, model: str, stage: int, limits: WireLimits, timeout: float = 120.0
) -> MateState:
    """Asks a peer for its stage's state, or StageStateError."""
    request = StateRequest(protocol_version=PROTOCOL_VERSION, model=model, stage=stage)
    reply, parts = await asyncio.wait_for(
        exchange(p2p, PeerID.from_base58(peer_id), STATE_PROTOCOL, [request], StateReply, limits), timeout
    )
    if reply.error.code != ErrorCode.OK:
        raise StageStateError(f"{ErrorCode.Name(reply.error.code)}: {reply.error.message}")
    if len(reply.recently_summed) > MAX_IDS:
        raise StageStateError(f"the state names {len(reply.recently_summed)} summed microbatches, over {MAX_IDS}")
    tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, limits)
    return MateState(
        step=reply.step,
        tensors=tensors,
        has_optimizer_state=reply.has_optimizer_state,
        samples_stepped=reply.samples_stepped,
        held={entry.peer: ids_from_wire(entry.ids) for entry in reply.held},
        attempt=reply.attempt,
        recently_summed=frozenset((i.trainer, int(i.microbatch)) for i in reply.recently_summed),
    )


def confirmed_versions(versions: dict[str, tuple[int, str]]) -> set[tuple[int, str]]:
    """The (step, fingerprint) pairs that at least two mates hold (or the one mate's, if only one answered)."""
    counts = Counter(versions.values())
    return {version for version, n in counts.items() if n >= min(2, len(versions))}


def confirmed_holders(versions: dict[str, tuple[int, str]], minimum_step: int = 0) -> list[str]:
    """Mates holding a confirmed version at `minimum_step` or later: the most advanced version first."""
    good = sorted((v for v in confirmed_versions(versions) if v[0] >= minimum_step), reverse=True)
    return [peer_id for version in good for peer_id, held in sorted(versions.items()) if held == version]
