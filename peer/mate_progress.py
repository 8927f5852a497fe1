"""Progress messages between stage-mates: which microbatches each holds toward the step, and its fingerprint.

A peer tells every member what it holds whenever that changes, and its parameter fingerprint after
every step. From what the mates hold it knows when the stage has its batch, and which backwards
that reach it as retries were applied elsewhere already (`held_elsewhere`). A replica whose
parameters differ from most of its mates' at the same step takes their state.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque

from hivemind.p2p import PeerID

from swarm.net.transport import PROGRESS_PROTOCOL, exchange
from swarm.net.wire import WireLimits
from swarm.peer.mate_membership import MateMembership
from swarm.peer.mate_messages import PROGRESS_TIMEOUT, Held, check_header, check_ids, ids_from_wire, ids_to_wire
from swarm.peer.protocol_handler import protocol_handler
from swarm.peer.runtime import SampleKey
from swarm.peer.step_machine import ACCUMULATING, StepMachine
from swarm.peer.work_receipts import DROPPED_STEPS_BEHIND, STATE_RECEIPT_STEPS
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, MateProgress, MateReply

logger = logging.getLogger(__name__)

# rounds whose summed microbatch ids a peer remembers: a backward retried on it after another replica's
# step summed it (its reply was lost) is then not summed again; a backward is refused past max_staleness
RECENT_ROUNDS = 8
# a mate's holdings at one step count up to this many target batches (two trainers' overlapping steps reach a
# peer during its round), and one microbatch over: a peer steps as soon as it holds its target
HELD_BATCHES = 2
# steps past its own whose progress a peer takes: its current step and the next count at once; a mate that
# stepped first may accumulate toward the step after next (during its round) while this peer still applies
# its step, and that progress is kept until this peer reaches it
LEAD_STEPS = 2
# steps per mate whose progress a peer keeps until it reaches them (a peer taking a state: any step ahead)
PARKED_STEPS = 2


def progress_refusal(step: int, current: int, held_samples: int, target: int, max_batch: int) -> str | None:
    """Why a mate's progress toward `step` is refused by a peer at step `current`, where it would then hold
    `held_samples` samples there; None where it is taken. Only the current step and the next `LEAD_STEPS` are
    taken (older progress no longer matters and is passed over by the caller), and at most `HELD_BATCHES`
    target batches and one microbatch at each: no peer holds more, so a claim beyond is no honest peer's."""
    if step > current + LEAD_STEPS:
        return (
            f"progress toward step {step}, this peer is at step {current}: only {current} to "
            f"{current + LEAD_STEPS} count"
        )
    bound = HELD_BATCHES * target + max_batch
    if held_samples > bound:
        return (
            f"holdings of {held_samples} samples at step {step}: a mate holds at most {bound} "
            f"({HELD_BATCHES} x the target batch {target} and a microbatch)"
        )
    return None


class ProgressExchange:
    """This peer's progress messages to its mates, theirs to it, and what it concludes from them."""

    def __init__(self, machine: StepMachine, membership: MateMembership) -> None:
        self.machine = machine
        self.membership = membership
        self.fingerprints: dict[str, tuple[int, str]] = {}  # per mate: its latest (step, fingerprint)
        self.divergences = 0
        self._sends: dict[asyncio.Task, str] = {}  # progress on its way, and the mate it goes to
        self._silent: set[str] = set()  # mates the last progress did not reach: not waited for until they speak
        self._recently_summed: deque[frozenset[SampleKey]] = deque(maxlen=RECENT_ROUNDS)
        self.summed_union: frozenset[SampleKey] = frozenset()  # of _recently_summed, rebuilt once a step
        # read on the runtime thread, replaced whole on the event loop (see held_elsewhere)
        self._elsewhere: frozenset[SampleKey] = frozenset()
        self.refused: Counter[str] = Counter()  # progress messages refused, per sender
        self._named: set[tuple[str, bool]] = set()  # (sender, refused for its step) named in a warning
        # per mate, its progress toward steps past this peer's own while it takes a state: step -> holdings
        self._parked: dict[str, dict[int, Held]] = {}
        self.handle = protocol_handler(MateProgress, self._new_reply, self._answer)

    def on_local_progress(self, step: int, held: Held) -> None:
        """This peer's holdings toward `step` changed: every member hears of them.

        While its round runs, a peer accumulates toward the next step: its mates hear of that too, so
        that should it die, they know what it held there as well."""
        machine = self.machine
        if not machine.runtime.step <= step <= machine.runtime.step + 1:
            return
        state = machine.steps[step]
        state.progress[machine.peer_id] = held
        # every member hears, also one that took a mate's state and is not in the DHT yet
        members = set(self.membership.mates) | set(state.progress) | self.membership.newcomers
        for peer_id in members - {machine.peer_id} - self.membership.departed():
            task = machine.spawn(self.send(peer_id, step, held))
            self._sends[task] = peer_id
            task.add_done_callback(lambda t: self._sends.pop(t, None))
        machine.advance(step)

    def tell(self, peers, step: int) -> None:
        """Sends this peer's progress at `step` to each of `peers`, in the background."""
        held = self.machine.own(step)
        for peer_id in peers:
            self.machine.spawn(self.send(peer_id, step, held))

    async def delivered(self) -> None:
        """Waits (at most `PROGRESS_TIMEOUT`) until the mates have heard of every sample accumulated so far.

        A backward is answered only after this: once a trainer holds the reply, the mates know which
        microbatches this peer holds, so should it die before the round they know exactly what was
        lost and ask for it again, instead of waiting for a batch that never fills. Mates the last
        progress did not reach are not waited for, so a dead mate does not slow every backward down, until
        they speak again: alive after all, a mate left out would not know what a wave took with this peer. Nor
        are mates that handed over and left the stage.
        """
        skipped = self._silent | self.membership.departed()
        pending = [task for task, mate in self._sends.items() if mate not in skipped]
        if pending:
            await asyncio.wait(pending, timeout=PROGRESS_TIMEOUT)

    async def send(self, peer_id: str, step: int, held: Held) -> None:
        """Tells `peer_id` what this peer holds toward `step`, with its fingerprint at that step."""
        machine = self.machine
        await machine.faults.hit("progress")
        dropped = machine.steps[step].dropped.get(machine.peer_id, {}) if step in machine.steps else {}
        message = MateProgress(
            protocol_version=PROTOCOL_VERSION,
            model=machine.model,
            stage=machine.stage,
            step=step,
            samples=sum(held.values()),
            held=ids_to_wire(held),
            fingerprint=machine.runtime.fingerprint_at(step),
            dropped=ids_to_wire(dropped),
        )
        if machine.receipts is not None:
            receipts, vouchers = machine.receipts.unacknowledged(peer_id, step, {**held, **dropped})
            message.receipts.extend(receipts)
            message.vouchers.extend(vouchers)
        try:
            reply, _ = await asyncio.wait_for(
                exchange(
                    machine.p2p, PeerID.from_base58(peer_id), PROGRESS_PROTOCOL, [message], MateReply, WireLimits()
                ),
                PROGRESS_TIMEOUT,
            )
            if machine.receipts is not None and reply.error.code == ErrorCode.OK:
                machine.receipts.acknowledged(peer_id, step, held)
            if peer_id in self._silent:
                self._silent.discard(peer_id)
                self.note_holdings()
        except Exception as e:  # the round itself tolerates a silent mate
            if peer_id not in self._silent:
                self._silent.add(peer_id)
                self.note_holdings()
            self.membership.newcomer_silent(peer_id)  # dropped if it never came up; a live one speaks for itself
            logger.debug(f"Could not send progress to {peer_id}: {type(e).__name__}: {e}")

    def _new_reply(self) -> MateReply:
        return MateReply(protocol_version=PROTOCOL_VERSION, step=self.machine.runtime.step)

    async def _answer(self, sender: str, message: MateProgress, _parts, reply: MateReply) -> list:
        machine = self.machine
        self.membership.heard_from(sender)
        if sender in self._silent:  # alive: waited for again before this peer answers a backward
            self._silent.discard(sender)
            self.note_holdings()
        error = check_header(message, machine.model, machine.stage)
        if (error := error or check_ids(machine.runtime.max_batch_samples, message.held, message.dropped)) is not None:
            reply.error.CopyFrom(error)
        elif message.step >= machine.runtime.step:  # older progress no longer matters
            self._take(sender, message, reply)
        return [reply]

    def _take(self, sender: str, message: MateProgress, reply: MateReply) -> None:
        """Takes a mate's progress toward the current step or a later one (refused, with the reason, past
        the bounds). Within a step a peer's holdings only grow, and progress messages may arrive out of
        order: an older, shorter one must not make this peer forget microbatches the sender holds."""
        machine = self.machine
        runtime = machine.runtime
        # past the next step, progress is kept until this peer reaches its step; a peer taking a state is
        # behind its mates by any number of steps: their progress counts from the step it will take
        taking_state = not machine.serving or machine.resyncing
        parking = message.step > runtime.step + 1
        if parking:
            before = self._parked.get(sender, {}).get(message.step, {})
        else:
            before = machine.steps[message.step].progress.get(sender, {}) if message.step in machine.steps else {}
        said = ids_from_wire(message.held)
        # a microbatch a recent round summed is held toward no later step: a mate's word that it is came from a
        # round that failed after it (what came in meanwhile goes back to the step the round retries)
        incoming = {key: n for key, n in said.items() if key not in self.summed_union}
        if machine.receipts is not None:  # a new microbatch counts with a vouched trainer's receipt only
            incoming = machine.receipts.screen_progress(
                sender, message.step, incoming, before, message.receipts, message.vouchers
            )
        merged = {**before, **incoming}
        # what it dropped to take a state (none parked: one taking a state is at its step)
        dropped = dropped_said = ids_from_wire(message.dropped) if not parking else {}
        if dropped and machine.receipts is not None:  # only what a receipt names the sender for
            dropped = machine.receipts.screen_progress(
                sender, message.step, dropped, {}, message.receipts, message.vouchers, DROPPED_STEPS_BEHIND
            )
        refusal = progress_refusal(
            message.step,
            message.step if taking_state and parking else runtime.step,
            sum(merged.values()) + sum(dropped.values()),
            runtime.target_batch_size,
            runtime.max_batch_samples,
        )
        if refusal is not None:
            self._refuse(sender, refusal, reply)
        elif parking:
            self._park(sender, message.step, merged)
        else:
            held = machine.steps[message.step].progress.setdefault(sender, {})
            held.update(incoming)
            # what it dropped to take a state it holds no more (unless sent to it again since): its earlier word
            # left in would count as a member holding them, and no round would expect them
            for key in dropped_said.keys() - said.keys():
                held.pop(key, None)
            self._expect_dropped(sender, message.step, dropped)
            self.note_holdings()
            if message.fingerprint:
                self.fingerprints[sender] = (message.step, message.fingerprint)
                self.compare_fingerprints()
            machine.advance(message.step)

    def _expect_dropped(self, sender: str, step: int, dropped: Held) -> None:
        """`sender` dropped `dropped` to take a state: this peer's round at `step` expects them too, so that they
        are found lost and sent again should the sender die before its round (it asks for them itself else)."""
        if not dropped:
            return
        self.machine.steps[step].dropped.setdefault(sender, {}).update(dropped)
        self.expect_lost(step, dropped)

    def expect_lost(self, step: int, dropped: Held) -> Held:
        """Makes the round at `step` expect those of `dropped` that no member holds and no recent round summed;
        returns them. Its round then finds them lost and their trainers send them again."""
        state = self.machine.steps[step]
        known = state.known()
        lost = {key: n for key, n in dropped.items() if key not in known and key not in self.summed_union}
        state.lost.update(lost)
        return lost

    def _park(self, sender: str, step: int, held: Held) -> None:
        """Keeps `sender`'s holdings toward `step`, past this peer's next, until this peer reaches it: only the
        latest `PARKED_STEPS` steps per mate, so what one mate can make it keep stays bounded."""
        steps = self._parked.setdefault(sender, {})
        steps[step] = held
        for old in sorted(steps)[:-PARKED_STEPS]:
            del steps[old]

    def reached(self, step: int) -> None:
        """This peer stepped to `step`, or took a state of it: the mates' progress it kept toward `step` and the
        next one counts now (a mate that dies holding it is then found to have lost exactly that); progress
        toward earlier steps no longer matters, and toward later ones stays kept."""
        for sender in list(self._parked):
            steps = self._parked[sender]
            for at in [at for at in steps if at <= step + 1]:
                held = {key: n for key, n in steps.pop(at).items() if key not in self.summed_union}
                if at >= step and sender != self.machine.peer_id:
                    self.machine.steps[at].progress.setdefault(sender, {}).update(held)
            if not steps:
                del self._parked[sender]
        self.note_holdings()

    def _refuse(self, sender: str, refusal: str, reply: MateReply) -> None:
        """Answers a refused progress message with the reason; counted per sender, each kind logged once per sender."""
        self.refused[sender] += 1
        kind = (sender, refusal.startswith("progress toward"))  # a far step, or too much held: each named once
        level = logging.DEBUG if kind in self._named else logging.WARNING
        self._named.add(kind)
        logger.log(
            level, f"Refused progress from mate {sender}: {refusal} ({self.refused[sender]} refused from it so far)"
        )
        reply.error.CopyFrom(Error(code=ErrorCode.BAD_REQUEST, message=refusal))

    def compare_fingerprints(self) -> None:
        """A replica whose parameters differ from most of its mates' at the same step takes their state."""
        machine = self.machine
        step, mine = machine.runtime.version
        if not mine or not machine.serving or machine.resyncing or machine.steps[step].phase != ACCUMULATING:
            return  # (no fingerprint yet: its hash is under way, and compares once done)
        table = {p: fp for p, (s, fp) in self.fingerprints.items() if s == step and p in self.membership.mates}
        if machine.receipts is not None:  # with a trust root: only mates vouched trainers gave work to lately
            since = step - STATE_RECEIPT_STEPS
            table = {p: fp for p, fp in table.items() if machine.receipts.receipted_since(p, since)}
        if not table:
            return
        table[machine.peer_id] = mine
        counts = Counter(table.values())
        # the most common fingerprint; on a tie, the one the smallest peer id holds
        majority = min(counts, key=lambda fp: (-counts[fp], min(p for p, f in table.items() if f == fp)))
        if majority == mine:
            return
        holders = sorted(p for p, fp in table.items() if fp == majority)
        self.divergences += 1
        logger.warning(
            f"Stage {machine.stage} step {step}: this replica's parameters ({mine}) differ from "
            f"{counts[majority]} of {len(table)} replicas' ({majority}); taking the state of {holders[0]}"
        )
        machine.schedule_resync("its parameters differ from its mates'", source=holders[0], minimum_step=step)

    # --- what the mates hold ------------------------------------------------------------------------------

    def remember_summed(self, keys: frozenset[SampleKey]) -> None:
        """Adds one round's summed microbatches to the last RECENT_ROUNDS', and their union; forgets a mate's word
        that it holds one of them toward the current step or a later one.

        A mate whose round fails holds what came in during it toward the step the round retries, not the next: its
        word for the next step is stale once the retry sums them. Left in, the next round expects them, finds them
        held by no member, and steps short, counting them lost though the retry summed them (a CI run: 2 of 24)."""
        machine = self.machine
        self._recently_summed.append(keys)
        self.summed_union = frozenset().union(*self._recently_summed)
        machine.summed_recently = self.summed_union
        ahead = [state for step, state in machine.steps.items() if step >= machine.runtime.step]
        for state in ahead:
            for held in [held for peer, held in state.progress.items() if peer != machine.peer_id]:
                for key in keys & held.keys():
                    del held[key]

    def held_elsewhere(self) -> frozenset[SampleKey]:
        """Microbatches another replica holds toward the current step, or a recent step summed (any thread).

        A backward for one of them reached this peer as a retry: its first attempt was applied, but the
        reply never reached the trainer (lost, or late past the trainer's deadline). The runtime answers it
        without summing its gradient again. Should that replica die before the round, its holdings are
        lost by id and their trainers send them again, so skipping costs time at worst, never a sample.
        """
        return self._elsewhere

    def note_holdings(self) -> None:
        """Rebuilds `held_elsewhere` after what the mates hold, who is silent, or the step changed."""
        machine = self.machine
        state = machine.steps.get(machine.runtime.step)
        held: set[SampleKey] = set()
        if state is not None:
            for member, keys in state.progress.items():
                # a mate that progress no longer reaches is likely dead: a retry of its microbatches is summed
                # here, so the round need not wait for them (were it alive after all, the round counts them twice)
                if member != machine.peer_id and member not in self._silent:
                    held.update(keys)
        self._elsewhere = self.summed_union.union(held)
