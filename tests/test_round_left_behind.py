"""A round of a step the peer has left behind (it took a mate's state at a later step meanwhile) ends at once:
waiting on for its mates would hold up the later step's round, where the mates wait for this peer's offer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections import defaultdict
from types import SimpleNamespace

import torch
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from swarm.compression import get_codec
from swarm.net.transport import INFO_PROTOCOL
from swarm.net.wire import encode_tensor
from swarm.peer.averaging_round import AveragingRound
from swarm.peer.faults import FaultPlan
from swarm.peer.mate_membership import MateMembership
from swarm.peer.mate_messages import ids_to_wire
from swarm.peer.protocol_handler import protocol_handler
from swarm.peer.round_commits import MAX_VIEW_RETRIES, ViewsDiffer
from swarm.peer.round_waiting import RoundWaiting
from swarm.peer.state_transfer import MateState, take_holdings
from swarm.peer.step_machine import (
    CLAIM_PAUSE_S,
    Contribution,
    RoundLeftBehind,
    StepMachine,
    StepState,
    handovers_in,
    held_by_the_gone,
)
from swarm.proto import PROTOCOL_VERSION, Error, ErrorCode, GradContribution, MateReply, PeerInfo, PeerInfoRequest
from swarm.records.stage_records import SERVING, StageRecord

ME = "QmPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
MATE = "QmPeerMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMM"


class Membership:
    """One mate that never sends its offer (alive, but busy elsewhere)."""

    def __init__(self) -> None:
        self.mates = {MATE: None}
        self.state_source = None

    def mark_unreachable(self, peer_id: str) -> None:
        raise AssertionError(f"{peer_id} answered nothing wrong: it must not be dropped")


PROGRESS = SimpleNamespace(note_holdings=lambda: None)  # the mates' progress, of which the round tells it news


def stage_1_at_step_5() -> StepMachine:
    """The step machine of a peer of stage 1 of 2 at step 5, over a stand-in runtime (not serving yet)."""
    module = torch.nn.Linear(2, 2)
    module.stage, module.num_stages = 1, 2
    runtime = SimpleNamespace(module=module, step=5, max_batch_samples=64, target_batch_size=16)
    return StepMachine(runtime, ME, "gpt-tiny", FaultPlan())


def averaging_round() -> tuple[AveragingRound, SimpleNamespace]:
    machine = stage_1_at_step_5()
    runtime = machine.runtime
    machine.serving = True
    machine.start(p2p=None)
    averaging = AveragingRound(
        machine, Membership(), PROGRESS, averaging_timeout=30.0, short_wait=20.0, codec=get_codec("none")
    )

    async def offer_taken(*args, **kwargs) -> None:  # the mate takes this peer's offer and sends none back
        return None

    averaging._send_contribution = offer_taken
    return averaging, runtime


def test_a_round_waiting_for_a_mate_ends_as_soon_as_the_peer_loads_a_later_state():
    async def go() -> tuple[object, float]:
        averaging, runtime = averaging_round()
        started = time.monotonic()
        held = {("trainer", 1): 8}
        call = asyncio.create_task(averaging.round(5, torch.zeros(6), held))
        for _ in range(5):  # lets the round send its offer and wait for the mate's
            await asyncio.sleep(0)
        assert not call.done(), "a round waits for a live mate's offer"
        runtime.step = 7  # a state load, as `StageRuntime.load_state` makes it; `StageMates` then wakes the round
        averaging.machine.changed.set()
        return await asyncio.wait_for(call, 5), time.monotonic() - started

    result, waited = asyncio.run(go())
    assert result is None and waited < 2.0


def test_a_round_of_the_current_step_keeps_waiting_for_its_mates():
    async def go() -> bool:
        averaging, _ = averaging_round()
        call = asyncio.create_task(averaging.round(5, torch.zeros(6), {("trainer", 1): 8}))
        await asyncio.sleep(0.3)
        averaging.machine.changed.set()  # news that is no state load
        await asyncio.sleep(0.3)
        waiting = not call.done()
        call.cancel()
        return waiting

    assert asyncio.run(go())


def test_a_peer_taking_a_state_learns_what_members_hold_toward_that_step_and_the_next():
    """A member that did not know this peer yet told only the giver what it holds; the state this peer takes says
    what members hold toward its step and the next (where backwards go during a round), so should one of them die
    holding them, its next rounds find exactly those lost."""
    steps: dict = defaultdict(StepState)
    steps[8].progress[MATE] = {("t", 1): 8}
    given = MateState(
        step=8,
        tensors=[],
        has_optimizer_state=False,
        samples_stepped=0,
        held={MATE: {("t", 2): 8}, ME: {("t", 9): 8}},
        held_next={MATE: {("t", 3): 8}},
        attempt=0,
        recently_summed=frozenset(),
    )
    take_holdings(steps, 8, given, ME)
    assert steps[8].known() == {("t", 1): 8, ("t", 2): 8}  # its own holdings are its own to tell
    assert steps[9].known() == {("t", 3): 8}


def test_what_a_gone_mate_was_heard_to_hold_after_the_offers_is_expected_not_forgotten():
    """A mate's progress can reach this peer after the round's offers were made; if that mate then dies, the offers
    never named what it held: the round (or the next step's) must expect it, not drop it with the mate."""
    progress = {ME: {("t", 1): 8}, MATE: {("t", 2): 8, ("t", 3): 8}, "QmPeerGone": {("t", 4): 8, ("t", 5): 8}}
    assert held_by_the_gone(progress, {ME, MATE}, summed={("t", 5)}) == {("t", 4): 8}
    assert held_by_the_gone(progress, {ME, MATE, "QmPeerGone"}, summed=set()) == {}


def test_a_round_whose_member_refuses_the_commit_from_a_later_step_ends_without_stepping():
    """The member stepped on the round without this peer (its view of the members differed): stepping on it too
    would fork the stage, so the round ends and this peer takes the mates' state."""

    async def go() -> tuple[object, list]:
        averaging, averaging_runtime = averaging_round()
        machine = averaging.machine
        taken: list = []

        async def take_state(minimum_step, source):
            taken.append(minimum_step)
            return None

        async def call_mate(peer_id, protocol, frames, timeout, limits=None):  # the mate is at step 6 already
            return MateReply(step=6, error=Error(code=ErrorCode.OUT_OF_SYNC, message="this peer is at step 6"))

        machine.take_state, machine.call_mate = take_state, call_mate
        averaging_runtime.request_step = lambda step: None
        held = {("t", 2): 8}
        machine.steps[5].mailbox[0][MATE] = Contribution(8, None, frozenset({ME, MATE}), held, dict(held))
        result = await asyncio.wait_for(averaging.round(5, torch.zeros(6), {("t", 1): 8}), 5)
        await asyncio.sleep(0)  # the resync it scheduled
        return result, taken

    result, taken = asyncio.run(go())
    assert result is None and taken == [6]


def test_a_peer_whose_round_a_member_stepped_on_without_it_starts_no_new_round_until_the_resync_ends():
    """Else it would retry the round at once, be refused again, and spin; once a resync ends without a state,
    the step's rounds may go on."""

    async def go() -> tuple[list, list]:
        averaging, runtime = averaging_round()
        machine = averaging.machine
        requested: list = []
        runtime.request_step = requested.append
        runtime.target_batch_size = 8
        machine.steps[5].progress[MATE] = {("t", 2): 8}  # the step's batch is there: a round would start
        gate = asyncio.Event()

        async def take_state(minimum_step, source):
            await gate.wait()
            return None  # no mate gave a state

        machine.take_state = take_state
        machine.mate_stepped_past(5, MATE, 6)
        machine.advance(5)
        during = list(requested)
        gate.set()
        for _ in range(5):
            await asyncio.sleep(0)
        return during, requested

    during, after = asyncio.run(go())
    assert during == [] and after == [5]


def test_a_member_that_stepped_alone_on_a_state_no_mate_confirms_is_left_out_of_the_round_not_waited_for():
    """A wave run: a lone restorer stepped while newcomers joined; they, at the step behind, could neither take its
    state (no other mate confirms it) nor step without it, for 20 s. After one fruitless resync, its refusals from
    the later step no longer hold the round up, and the mates' ledger marks its step abandoned once they step."""

    async def go() -> tuple[list, list, set]:
        averaging, runtime = averaging_round()
        machine = averaging.machine
        requested: list = []
        runtime.request_step = requested.append
        runtime.target_batch_size = 8
        machine.steps[5].progress[MATE] = {("t", 2): 8}

        async def take_state(minimum_step, source):
            return None  # the mate's state at step 6 is confirmed by no other mate

        machine.take_state = take_state
        machine.mate_stepped_past(5, MATE, 6)
        for _ in range(5):
            await asyncio.sleep(0)
        first = list(requested)
        machine.stepped_without = -1  # the next attempt of the round starts (`AveragingRound.round`)
        machine.mate_stepped_past(5, MATE, 6)  # and the mate refuses its offer again
        held_up = machine.stepped_without >= 5 or machine.resyncing
        return first, [held_up], machine.outran.get(5, set())

    first, held_up, outran = asyncio.run(go())
    assert first == [5]  # the step's round went on after the fruitless resync
    assert held_up == [False]  # a second refusal from the lone mate starts no resync and leaves the round alone
    assert outran == {MATE}


def test_mates_gone_after_announcing_a_later_step_are_named_when_the_peer_steps_on_its_own():
    """A replay: a holder restored a lost stage and stepped twice alone while a newcomer restored the same copy; it
    died before the newcomer could take its state. The newcomer stepped from the older step: its ledger must mark
    the dead one's two steps abandoned, or their samples count as silently lost and its step as divergent."""
    machine = stage_1_at_step_5()  # not serving: the records start no resync here
    other = "QmPeerOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOOO"

    def record(peer: str, step: int) -> StageRecord:
        return StageRecord(peer, 1, "gpt-tiny", 2, SERVING, step, 10.0, 0, 16, 0, PROTOCOL_VERSION)

    machine.check_behind({MATE: record(MATE, 7), other: record(other, 6)})  # this peer is at step 5
    assert machine.left_ahead(5, {MATE, other}) == {}  # both live: no history abandoned
    assert machine.left_ahead(5, {other}) == {MATE: 7}  # MATE is gone: its steps 5 and 6 are abandoned
    assert machine.left_ahead(6, {other}) == {}  # said once; and `other`, at 6, was no longer ahead
    machine.check_behind({MATE: record(MATE, 9)})
    machine.forget_behind(9)  # a state load to step 9: nobody is ahead any more
    assert machine.left_ahead(9, set()) == {}


# --- a leaving mate's hand-over in the rounds after it ----------------------------------------------------------


def contribution(samples: int, handover: bool = False) -> Contribution:
    return Contribution(samples, torch.ones(6), frozenset({ME, MATE}), {(MATE, samples): samples}, handover=handover)


def test_a_hand_over_survives_the_failure_of_an_attempt_the_leaving_mate_had_offered_in():
    """Traced in a wave run: the mate offered in attempt 0, left, and handed over in attempt 1; attempt 0 then
    failed here, and its retry put the mate's old offer over the hand-over. Attempt after attempt expected the
    gone mate's slice parts, and the stage stood still for 60 s."""

    async def go() -> None:
        averaging, _ = averaging_round()
        state = averaging.machine.steps[5]
        state.mailbox[0].update({ME: contribution(8), MATE: contribution(8)})
        state.mailbox[1][MATE] = contribution(8, handover=True)
        averaging._retry(5, state, 0, state.mailbox[0], "a mate gave attempt 0 up")
        assert state.mailbox[1][MATE].handover
        assert handovers_in(state.mailbox[1]) == {MATE}
        state.mailbox[1][ME] = contribution(8)
        averaging._retry(5, state, 1, state.mailbox[1], "again")
        assert set(state.mailbox[2]) == {MATE} and state.mailbox[2][MATE].handover, "only hand-overs carry over"
        assert not averaging.machine.started_by_mate(state), "a hand-over starts no round: its sender has left"

    asyncio.run(go())


async def hand_over_to(averaging: AveragingRound, held: dict) -> Error:
    """MATE's hand-over of `held` at step 5, attempt 0, as `averaging` takes it."""
    header = GradContribution(
        protocol_version=PROTOCOL_VERSION,
        model="gpt-tiny",
        stage=1,
        step=5,
        samples=sum(held.values()),
        members=sorted({ME, MATE}),
        handover=True,
        attempt=0,
        held=ids_to_wire(held),
        norm=1.0,
    )
    return await averaging._accept_contribution(MATE, header, encode_tensor(torch.ones(6), get_codec("none")))


def test_a_hand_over_sent_at_an_earlier_attempt_joins_the_attempt_under_way():
    """A leaving mate hands over at the attempt it knew; where the round has been retried since, the gradients
    are still good (its samples would otherwise be lost with it)."""

    async def go() -> tuple[Error, StepState]:
        averaging, _ = averaging_round()
        state = averaging.machine.steps[5]
        state.attempt = 2
        error = await hand_over_to(averaging, {(MATE, 3): 8})
        return error, state

    error, state = asyncio.run(go())
    assert error.code == ErrorCode.OK
    assert state.mailbox[2][MATE].handover and state.mailbox[2][MATE].samples == 8


LEAVER = "QmPeerLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLL"


def test_a_hand_over_a_committing_mate_lacks_is_left_out_here_too():
    """Traced in a rebalancing run: a peer moved to another stage, handing its samples over to the one mate it
    had; a newcomer then took that mate's state within the same round and never got the hand-over. Kept here
    regardless, the two summed different contributions attempt after attempt (4 minutes). Left out alike, its
    samples are found lost at both and sent again."""

    async def go() -> set[str] | None:
        averaging, _ = averaging_round()
        machine = averaging.machine

        async def call_mate(peer_id, protocol, frames, timeout, limits=None):  # the commit is taken
            return MateReply()

        machine.call_mate = call_mate
        state = machine.steps[5]
        state.mailbox[0].update({ME: contribution(8), MATE: contribution(8), LEAVER: contribution(4, handover=True)})
        state.commits[0][MATE] = frozenset({ME, MATE})  # the newcomer holds no hand-over
        return await asyncio.wait_for(averaging.commits.agree(5, 0, state, {ME, MATE, LEAVER}), 5)

    assert asyncio.run(go()) == {ME, MATE}


LIAR = "QmPeerZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ"


def test_committers_that_leave_out_a_committer_give_the_attempt_up_rather_than_sum_without_a_live_mate():
    """Traced with insiders on every stage: an accusation reached the two honest mates a second apart. One had
    dropped the liar, whose commit left that one out; the other, summing what all its committers held, summed
    alone, asked the trainers again for samples its live mate held, and counted them twice a step later. A
    committer left out is a view conflict: the attempt is given up after a fresh read of the accusations, at
    most `MAX_VIEW_RETRIES` times a step (a liar in every commit cannot stall the stage), then summed as before."""

    async def go() -> tuple[list[str], set[str] | None, int]:
        averaging, _ = averaging_round()
        machine = averaging.machine
        reads = []

        async def read_accusations_now(timeout: float) -> None:
            reads.append(timeout)

        async def call_mate(peer_id, protocol, frames, timeout, limits=None):  # every commit is taken
            return MateReply()

        averaging.membership.read_accusations_now = read_accusations_now
        machine.call_mate = call_mate
        state = machine.steps[5]
        outcomes = []
        for attempt in range(MAX_VIEW_RETRIES + 1):
            state.mailbox[attempt].update({ME: contribution(8), MATE: contribution(8), LIAR: contribution(8)})
            state.commits[attempt].update({MATE: frozenset({ME, MATE}), LIAR: frozenset({ME, LIAR})})
            try:
                agreed = await asyncio.wait_for(averaging.commits.agree(5, attempt, state, {ME, MATE, LIAR}), 5)
            except ViewsDiffer as e:
                outcomes.append(str(e))
            else:
                return outcomes, agreed, len(reads)
        return outcomes, None, len(reads)

    outcomes, agreed, reads = asyncio.run(go())
    assert len(outcomes) == MAX_VIEW_RETRIES and all(MATE in o and LIAR in o for o in outcomes)
    assert reads == MAX_VIEW_RETRIES  # each conflict read the accusations before the next attempt
    assert agreed == {ME}  # past the bound: what every committer holds, as before


NEWCOMER = "QmPeerNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNNN"


def nothing(known: dict | None = None) -> Contribution:
    """The offer of a newcomer whose state came while the round was under way: no samples, no gradient."""
    return Contribution(0, None, frozenset({ME, MATE, NEWCOMER}), {}, dict(known or {}))


def commit_round(mailbox: dict, commits: dict, view: set[str], take_state=None):
    """Runs this peer's commit phase of step 5's attempt 0 over `mailbox` and the mates' `commits`; returns what it
    agreed on (or the exception it raised), the accusation reads it made and the resyncs it asked for."""

    async def go():
        averaging, _ = averaging_round()
        machine = averaging.machine
        reads, resyncs = [], []

        async def read_accusations_now(timeout: float) -> None:
            reads.append(timeout)

        async def call_mate(peer_id, protocol, frames, timeout, limits=None):
            return MateReply()

        async def taken(minimum_step, source):
            resyncs.append(minimum_step)
            return None

        averaging.membership.read_accusations_now = read_accusations_now
        machine.call_mate = call_mate
        machine.take_state = take_state or taken
        state = machine.steps[5]
        state.mailbox[0].update(mailbox)
        state.commits[0].update(commits)
        try:
            outcome = await asyncio.wait_for(averaging.commits.agree(5, 0, state, view), 5)
        except Exception as e:
            outcome = e
        for _ in range(5):
            await asyncio.sleep(0)
        return outcome, reads, resyncs, machine.stepped_without

    return asyncio.run(go())


def test_a_newcomer_offering_nothing_that_a_committer_left_out_costs_the_round_no_attempt():
    """Traced: a newcomer took its state while its mates' round was under way and offered nothing in it; one mate's
    commit named it, the other's did not, and the views-differ retry (a fresh read of the accusations, the members'
    late notice) held the stage's step for 2 s. Its offer changes no sum: the round goes on without it."""
    mailbox = {ME: contribution(8), MATE: contribution(8), NEWCOMER: nothing({(MATE, 8): 8})}
    commits = {MATE: frozenset({ME, MATE}), NEWCOMER: frozenset({ME, MATE, NEWCOMER})}
    agreed, reads, resyncs, _ = commit_round(mailbox, commits, {ME, MATE, NEWCOMER})
    assert agreed == {ME, MATE} and reads == [] and resyncs == []


def test_a_left_out_offer_of_nothing_that_knows_of_a_microbatch_the_round_does_not_is_still_a_conflict():
    """What it knew a member held, and no agreed offer names, would be lost unasked without it."""
    mailbox = {ME: contribution(8), MATE: contribution(8), NEWCOMER: nothing({("t", 3): 8})}
    commits = {MATE: frozenset({ME, MATE}), NEWCOMER: frozenset({ME, MATE, NEWCOMER})}
    outcome, reads, _, _ = commit_round(mailbox, commits, {ME, MATE, NEWCOMER})
    assert isinstance(outcome, ViewsDiffer) and NEWCOMER in str(outcome) and len(reads) == 1


def test_a_newcomer_whose_offer_of_nothing_the_mates_summed_without_takes_their_state_after_the_round():
    """Its side of the same round: neither step alone on the sum nor give the attempt up, but end the round and
    take the mates' state of the next step."""
    mailbox = {ME: nothing(), MATE: contribution(8)}
    commits = {MATE: frozenset({MATE})}
    outcome, reads, resyncs, stepped_without = commit_round(mailbox, commits, {ME, MATE})
    assert isinstance(outcome, RoundLeftBehind) and reads == []
    assert resyncs == [6] and stepped_without == 5


# --- one mate's word that it is ahead ---------------------------------------------------------------------------


def test_a_mate_claiming_a_far_step_in_every_offer_starts_one_resync_per_pause_not_one_per_offer():
    """A member that claims step 2**62 in each offer is refused each time; after one resync that found no state,
    its claims start no other until `CLAIM_PAUSE_S` has passed (the records' check stays the proof)."""

    async def go() -> tuple[list, list, list]:
        averaging, _ = averaging_round()
        machine = averaging.machine
        taken: list = []

        async def take_state(minimum_step, source):
            taken.append(minimum_step)
            return None  # nobody holds such a step

        machine.take_state = take_state
        header = GradContribution(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=2**62)
        codes = []
        for _ in range(20):
            error = await averaging._accept_contribution(MATE, header, [])
            codes.append(error.code)
            await asyncio.sleep(0)
        first = list(taken)
        machine.fruitless_at -= CLAIM_PAUSE_S  # the pause has passed
        await averaging._accept_contribution(MATE, header, [])
        await asyncio.sleep(0)
        return codes, first, taken

    codes, first, taken = asyncio.run(go())
    assert set(codes) == {ErrorCode.OUT_OF_SYNC}
    assert first == [6] and taken == [6, 6]


def test_a_round_whose_only_mate_handed_over_and_left_steps_without_waiting_for_it():
    """A mate that left the stage handed this peer its gradient: the round sums it and steps at once. It used to
    wait out the grace for absent mates (5 s, every attempt) for an offer it never sends a leaver."""

    async def go() -> tuple[object, float]:
        averaging, _ = averaging_round()
        machine = averaging.machine
        state = machine.steps[5]
        members = frozenset({ME, MATE})
        state.mailbox[0][MATE] = Contribution(8, torch.ones(6), members, {("t", 2): 8}, {}, norm=6**0.5, handover=True)
        started = time.monotonic()
        result = await asyncio.wait_for(averaging.round(5, torch.ones(6), {("t", 1): 8}), 10)
        return result, time.monotonic() - started

    result, waited = asyncio.run(go())
    assert result is not None and result.samples == 16, result
    assert waited < 2.0, f"the round waited {waited:.1f}s for a mate that left"


def test_a_member_a_probe_finds_past_the_round_is_left_out_once_no_state_of_its_can_be_taken():
    # a wave run: a restorer stepped with one newcomer, the other two newcomers' probes found it a step ahead, it
    # left the stage, and they stepped on their own; the ledger showed two lines of one step, with no restore
    # between them. Found past the round by a probe, as by a reply from a later step, the member stepped on the
    # round without this peer: the round ends, and where its state cannot be had, goes on without it, its step
    # marked abandoned (`outran`, which the ledger line before this peer's own says)
    async def go() -> tuple[int, set, set, list]:
        averaging, _ = averaging_round()
        machine, taken = averaging.machine, []
        member = await P2P.create()
        asker = await P2P.create(initial_peers=[str(a) for a in await member.get_visible_maddrs()])
        try:

            async def answer(sender, request, parts, reply) -> list:
                return [reply]

            reply = PeerInfo(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, num_stages=2, step=6)
            await member.add_binary_stream_handler(
                INFO_PROTOCOL, protocol_handler(PeerInfoRequest, lambda: reply, answer)
            )

            async def take_state(minimum_step, source):
                taken.append(minimum_step)
                return None  # the member left the stage meanwhile: its state is not to be had

            machine.p2p, machine.take_state = asker, take_state
            gone: set[str] = set()
            await RoundWaiting(machine, Membership(), 30.0)._probe(5, str(member.peer_id), gone)
            ended_round = machine.stepped_without
            for _ in range(20):  # the resync runs in the background
                await asyncio.sleep(0)
            return ended_round, gone, machine.outran.get(5, set()), taken
        finally:
            await asker.shutdown()
            await member.shutdown()

    ended_round, gone, outran, taken = asyncio.run(asyncio.wait_for(go(), 60))
    assert ended_round == 5 and not gone, "the round ends: the member lives, a step ahead"
    assert taken == [6] and outran and len(outran) == 1, "no state of its: the round goes on without it"


# --- a mate that stepped on a round, and left, before this peer finished it ---------------------------------------


def test_a_mover_that_stepped_on_other_parameters_has_its_step_abandoned(tmp_path) -> None:
    """A wave run's replay: a holder stepped on step 86 while its newcomer mate was still in the round, then moved to
    restore an empty stage, handing over only its step-87 samples. The newcomer's round failed and it stepped on 86
    alone, on another sum. Before 04b43e5's rule was extended to movers, the ledger counted step 86 as divergent."""
    from swarm.peer.mates import StageMates
    from swarm.peer.runtime import RoundResult
    from swarm.records.sample_ledger import SampleLedger, account, fed_record, read_ledger, step_record
    from swarm.records.stage_records import LEAVING

    mover_fp, own_fp, older_fp = "a" * 16, "b" * 16, "c" * 16
    module = torch.nn.Linear(2, 2)
    module.stage, module.num_stages = 1, 2

    def runtime() -> SimpleNamespace:
        return SimpleNamespace(module=module, step=86, max_batch_samples=64, target_batch_size=16)

    def leaving(versions: tuple[tuple[int, str], ...]) -> StageRecord:
        return StageRecord(
            LEAVER, 1, "gpt-tiny", 2, LEAVING, 87, 10.0, 0, 16, 0, PROTOCOL_VERSION, moving_to=0, versions=versions
        )

    trainer = "trainer-0"
    mine, its_own = (trainer, 1, 8), (trainer, 2, 8)  # the newcomer held one; the mover the other, both summed
    fed = [fed_record(trainer, mb, 8) for mb in (1, 2)]

    async def step_after(versions: tuple[tuple[int, str], ...], path) -> list[dict]:
        mates = StageMates(runtime(), ME, "gpt-tiny", ledger=SampleLedger(path))
        mates.machine.loop = asyncio.get_running_loop()
        mates.membership.take_records([leaving(versions)])
        mates._after_step(87, own_fp, RoundResult(None, 8, ids=[mine]))
        return read_ledger(path)

    forked = asyncio.run(step_after(((86, older_fp), (87, mover_fp)), tmp_path / "forked.jsonl"))
    assert [line["kind"] for line in forked] == ["restore", "step"]
    assert forked[0]["step"] == 86 and forked[1]["step"] == 86
    mover_line = step_record(LEAVER, 1, 86, [mine, its_own], [], mover_fp)
    mover_line["time"] = forked[0]["time"] - 1  # it stepped first
    unmarked = account(fed, [mover_line, forked[1]])["stages"][1]
    assert unmarked["divergent_steps"] == [86]  # what the ledger said without the restore line
    stage = account(fed, [mover_line, *forked])["stages"][1]
    assert stage["divergent_steps"] == [] and stage["steps_rolled_back"] == 1
    assert stage["rolled_back_ids"] == [[trainer, 2]] and stage["samples_silently_lost"] == 0

    # the same parameters: the mover's step is this peer's, and nothing is abandoned
    same = asyncio.run(step_after(((86, older_fp), (87, own_fp)), tmp_path / "same.jsonl"))
    assert [line["kind"] for line in same] == ["step"]


# --- a mate that leaves holding nothing -------------------------------------------------------------------------


def serving(peer: str, expiration: float) -> StageRecord:
    return StageRecord(peer, 1, "gpt-tiny", 2, SERVING, 5, 10.0, 0, 16, 0, PROTOCOL_VERSION, expiration=expiration)


def test_a_mate_that_leaves_holding_nothing_says_so_and_no_later_round_waits_for_it():
    """A p3 replay: a restorer left its stage holding no samples, so it handed nothing over and said nothing; its
    mate's next round counted it a member from its serving record, which outlives a move by seconds, and waited
    until a call to it was refused by the stage it had moved to (0.5 to 1 s, on a step that had lost a stage)."""

    async def go() -> tuple[list, MateMembership, StageRecord]:
        # the leaving side: nothing held, one mate
        leaver, runtime = averaging_round()
        runtime.held = {}
        runtime.flat_gradient = lambda: torch.zeros(6)
        runtime.run_exclusive = lambda fn: _done(fn())
        leaver.membership.mates = {MATE: serving(MATE, get_dht_time() + 10)}
        sent: list = []

        async def send(peer_id, step, own, members, unreachable, handover=False, attempt=0) -> None:
            sent.append((peer_id, step, own.samples, own.grad_sum, handover))

        leaver._send_contribution = send
        handed = await leaver.hand_over()
        # the mate's side: the hand-over arrives and the leaver is out of its rounds, its record notwithstanding
        runtime = SimpleNamespace(
            module=leaver.machine.runtime.module, step=5, max_batch_samples=64, target_batch_size=16
        )
        machine = StepMachine(runtime, MATE, "gpt-tiny", FaultPlan())  # the mate, with the leaver (ME) its mate
        machine.serving = True
        machine.start(p2p=None)
        membership = MateMembership(machine)
        record = serving(ME, get_dht_time() + 10)
        membership.take_records([record])
        assert ME in membership.mates
        mate = AveragingRound(
            machine, membership, None, averaging_timeout=30.0, short_wait=20.0, codec=get_codec("none")
        )
        header = GradContribution(
            protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=9, samples=0, handover=True
        )
        error = await mate._answer_contribution(ME, header, [], MateReply())
        assert error.code == ErrorCode.OK
        assert not machine.resyncing, "holding nothing, a leaver's step claims nothing"
        assert ME not in membership.mates and ME in mate.departed
        assert not membership.joins_stage(ME), "a state it asks for now is a standby copy: it is no newcomer"
        membership.take_records([record])  # the same record, read again before it lapses
        return [sent, handed, set(membership.mates)], membership, record

    (sent, handed, mates_after_reread), membership, record = asyncio.run(go())
    assert sent == [(MATE, 5, 0, None, True)], "it tells its mate it leaves, with no gradient"
    assert handed is None, "nothing held: nothing for the ledger"
    assert mates_after_reread == set(), "its old record makes no mate of it"

    async def back() -> set:
        membership.machine.loop = asyncio.get_running_loop()
        renewed = dataclasses.replace(record, expiration=record.expiration + 5)
        membership.take_records([renewed])  # it came back and announced itself anew
        return set(membership.mates)

    assert asyncio.run(back()) == {ME}


def _done(value: object) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def test_a_peer_stepping_without_the_mate_it_took_its_state_from_at_the_step_marks_that_mates_step_abandoned():
    """Traced in a p3 replay: a newcomer took a stage's state at step 62 from its only peer, which left it out of
    its own round there (as a giver does), stepped on 62 alone and was killed a second later; the newcomer stepped
    on 62 with other microbatches, and the ledger found two replicas of step 62 with different parameters. The
    newcomer's round, stepping without its giver, now says the giver's step may be a history abandoned."""

    async def go(giver_in_round: bool) -> tuple[object, list]:
        averaging, _ = averaging_round()
        machine = averaging.machine
        forks: list = []
        averaging.on_fork = lambda step, dead: forks.append((step, dead))
        state = machine.steps[5]
        state.giver = MATE
        if giver_in_round:  # it handed its gradient over: it is in the round, and steps on the same sum
            members = frozenset({ME, MATE})
            handover = Contribution(8, torch.ones(6), members, {("t", 2): 8}, {}, norm=6**0.5, handover=True)
            state.mailbox[0][MATE] = handover
        else:  # its record is gone: it died
            averaging.membership.mates = {}
        result = await asyncio.wait_for(averaging.round(5, torch.ones(6), {("t", 1): 8}), 10)
        return result, forks

    result, forks = asyncio.run(go(giver_in_round=False))
    assert result is not None and forks == [(5, {MATE})]
    result, forks = asyncio.run(go(giver_in_round=True))
    assert result is not None and forks == []
