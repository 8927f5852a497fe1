"""What one member with a valid key and signed records can do cheaply through records and messages, bounded:
a record with other settings is named and ignored, throughput claims count within their stage's bounds, the
trainer-record cap counts sound records only, mates' progress counts for the current and the next step only and
up to a bound, and a request's tensors are checked by their headers before any is decoded."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

import pytest
import torch
from conftest import (
    TARGET,
    peer_flags,
    run_as_stage_members,
    trainer_flags,
    wait_for_records,
)
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

import swarm.records.trainer_records as trainer_records
from swarm.compression import get_codec
from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.models.stage_io import StageInputError, check_stage_inputs
from swarm.net.dht_node import TetheredDHT
from swarm.net.request_limits import undecoded_problem
from swarm.net.transport import PROGRESS_PROTOCOL, exchange
from swarm.net.wire import Part, WireLimits, encode_tensor
from swarm.peer.faults import FaultPlan
from swarm.peer.mate_membership import UNREACHABLE_HOLD, MateMembership
from swarm.peer.mate_progress import HELD_BATCHES, ProgressExchange, progress_refusal
from swarm.peer.runtime import StageRuntime
from swarm.peer.state_transfer import confirmed_holders
from swarm.peer.step_machine import StepMachine
from swarm.policy.balance import PeerLoad, loads_from_records, plan_moves
from swarm.policy.claim_bounds import CLAIM_MULTIPLE, bounded_claims, lower_median
from swarm.policy.router import Router
from swarm.proto import PROTOCOL_VERSION, ErrorCode, MateProgress, MateReply, SampleId, Tensor
from swarm.records.announced_settings import differing_settings, disagreements, used_settings
from swarm.records.stage_records import JOINING, SERVING, StageRecord, announce
from swarm.records.trainer_records import TrainerRecord, fetch_trainer_records, publish, sound_trainer_records

PEERS = [f"12D3KooW{c * 44}" for c in "ABCDEFGH"]  # distinct well-formed peer ids


def record(peer: str, stage: int = 0, throughput: float = 10.0, state: str = SERVING, **changes) -> StageRecord:
    fields = dict(
        peer_id=peer,
        stage=stage,
        model="gpt-tiny",
        num_stages=3,
        state=state,
        step=0,
        throughput=throughput,
        queue_length=0,
        target_batch_size=16,
        stale_gradients=0,
        protocol_version=PROTOCOL_VERSION,
        expiration=1e12,
        dtype="fp32",
    )
    return StageRecord(**{**fields, **changes})


# --- 1. a record that disagrees with the swarm's settings -------------------------------------------------------


def test_a_disagreeing_record_is_named_with_what_it_said_and_what_is_used():
    records = [record(PEERS[0]), record(PEERS[1], 1), record(PEERS[2], 2), record(PEERS[3], target_batch_size=64)]
    (found,) = disagreements(records, {"model": "gpt-tiny"})
    assert (found.peer_id, found.setting, found.announced, found.used) == (PEERS[3], "target_batch_size", 64, 16)
    assert found.describe() == (
        f"Ignoring peer {PEERS[3]} of stage 0: it announces target_batch_size 64, this process uses 16 "
        "(as 3 of 4 serving peers announce)"
    )
    # this process's own setting decides where it has one, however many peers say otherwise
    own = disagreements(records, {"target_batch_size": 64})
    assert {d.peer_id for d in own} == set(PEERS[:3]) and own[0].basis == "this process's own setting"
    # a record from before a setting existed says nothing of it; one peer counts once, whatever it holds
    assert disagreements([*records[:3], record(PEERS[3], dtype="")], {}) == []
    doubled = [record(PEERS[0]), record(PEERS[1], target_batch_size=64), record(PEERS[1], 1, target_batch_size=64)]
    assert "target_batch_size" not in used_settings(doubled, {})


def test_one_serving_identity_alone_never_stops_a_newcomer():
    from swarm.config import TrainerConfig, load_config

    trainer = load_config(TrainerConfig, {"num_stages": 3, "model": "gpt-tiny"}, environ={})
    lone = [record(PEERS[0], model="gpt-micro")]  # the only serving record: a hostile one
    assert differing_settings(trainer, lone) is None
    assert "--model gpt-micro (you gave gpt-tiny)" in differing_settings(
        trainer, [*lone, record(PEERS[1], model="gpt-micro")]
    )


def test_on_a_tie_no_single_identity_decides():
    tie = [record(PEERS[0]), record(PEERS[1], target_batch_size=64)]
    assert "target_batch_size" not in used_settings(tie, {}) and disagreements(tie, {}) == []
    # whatever its peer id: a tie is a tie in either order
    assert "target_batch_size" not in used_settings(tie[::-1], {})
    majority = used_settings([*tie, record(PEERS[2], 2)], {})
    assert majority["target_batch_size"] == (16, "as 2 of 3 serving peers announce")


@pytest.mark.timeout(300)
def test_a_serving_record_with_another_target_batch_size_does_not_stop_a_trainer(local_swarm, tmp_path):
    """Before, one SERVING record with another --target-batch-size stopped every trainer at start ("peers disagree
    on --target-batch-size"). Now the trainer trains with the majority's and names the record once."""
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(tmp_path / f"peer{stage}"))
    wait_for_records(local_swarm.initial_peers, lambda r: all(any(p.state == SERVING for p in r[s]) for s in range(3)))
    hostile = TetheredDHT(initial_peers=local_swarm.initial_peers, start=True)
    try:
        liar = str(hostile.peer_id)
        claim = record(liar, 0, target_batch_size=4 * TARGET, throughput=1e9, dtype="")
        assert announce(hostile, "swarm", claim, ttl=300.0)
        summary_file = tmp_path / "summary.json"
        trainer = local_swarm.start_trainer("trainer", trainer_flags(3, summary_file))
        assert trainer.wait(200) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    finally:
        hostile.shutdown()
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 3 and summary["samples"] == 3 * TARGET, summary
    log = local_swarm.log_path("trainer").read_text()
    named = f"Ignoring peer {liar} of stage 0: it announces target_batch_size {4 * TARGET}, this process uses {TARGET}"
    assert log.count(named) == 1, log[-3000:]


# --- 2. throughput claims ---------------------------------------------------------------------------------------


def test_a_claim_far_above_its_stage_counts_as_a_typical_peer_and_one_within_counts_as_it_is():
    assert lower_median([10.0, 1e9]) == 10.0 and lower_median([3.0, 1.0, 2.0]) == 2.0 and lower_median([]) == 0.0
    counted, ignored = bounded_claims({"a": 10.0, "b": 12.0, "liar": 1e9, "new": 0.0})
    assert counted == {"a": 10.0, "b": 12.0, "liar": 12.0, "new": 0.0} and ignored == {"liar": 1e9}
    fast = 0.9 * CLAIM_MULTIPLE * 10.0  # a much faster peer of the stage, honestly: it keeps its weight
    assert bounded_claims({"a": 10.0, "b": 10.0, "fast": fast})[0]["fast"] == fast
    # what a trainer timed lifts the bound: a claim near a measured speed is believed
    assert bounded_claims({"a": 1.0, "b": 1.0, "gpu": 100.0}, measured=50.0)[1] == {}


def stage_records(layout: dict[int, list[float]]) -> dict[int, list[StageRecord]]:
    peers = iter(f"12D3KooW{i:044d}" for i in range(100))
    return {s: [record(next(peers), s, t) for t in speeds] for s, speeds in layout.items()}


def test_a_claim_of_1e9_moves_no_peer_and_every_peer_computes_the_same_plan():
    honest = {0: [10.0, 10.0], 1: [10.0, 10.0], 2: [10.0, 10.0]}
    with_liar = stage_records({**honest, 0: [*honest[0], 1e9]})
    as_typical = stage_records({**honest, 0: [*honest[0], 10.0]})
    plan = plan_moves(loads_from_records(with_liar), 3, margin=0.1)
    assert plan == [] == plan_moves(loads_from_records(as_typical), 3, margin=0.1)
    assert max(p.throughput for p in loads_from_records(with_liar)) == 10.0
    # taken at its word, the claim would empty stage 0 of its honest peers
    believed = [PeerLoad(r.peer_id, s, r.throughput) for s, recs in with_liar.items() for r in recs]
    assert len(plan_moves(believed, 3, margin=0.1)) == 2
    # pure: every peer reads the records in its own order and computes the same plan
    skewed = stage_records({0: [10.0, 10.0, 10.0, 1e9], 1: [10.0], 2: [5.0, 5.0, 5.0]})
    plans = set()
    for seed in range(5):
        shuffled = {s: random.Random(seed).sample(recs, len(recs)) for s, recs in skewed.items()}
        plans.add(tuple(plan_moves(loads_from_records(shuffled), 3, margin=0.1)))
    assert len(plans) == 1


def test_a_claim_of_1e9_draws_no_more_calls_than_an_honest_newcomer():
    def calls_to_newcomer(claim: float) -> int:
        router = Router(rng=random.Random(0), clock=lambda: 0.0)
        recs = [record(PEERS[0]), record(PEERS[1]), record(PEERS[2], throughput=claim)]
        router.update({0: recs}, 0.0)
        return sum(router.choose(0, backward=True, samples=5).peer_id == PEERS[2] for _ in range(30))

    assert calls_to_newcomer(1e9) == calls_to_newcomer(10.0) <= 11
    router = Router(clock=lambda: 0.0)
    router.update({0: [record(PEERS[0], throughput=1.0), record(PEERS[1], throughput=100.0)]}, 0.0)
    router.report_success(PEERS[0], backward=True, samples=10, seconds=0.1)  # timed at 100 samples/s
    assert router.measured == {0: pytest.approx(100.0)}
    assert router.believed_throughput(record(PEERS[1], throughput=100.0)) == 100.0


def test_the_trainer_names_a_claim_it_does_not_believe_once(caplog):
    from types import SimpleNamespace

    from swarm.trainer.peer_finder import PeerFinder

    finder = PeerFinder(None, SimpleNamespace(trust_root=None, run_id="swarm"), 256, Router())
    stage = [record(PEERS[0]), record(PEERS[1]), record(PEERS[2], throughput=1e9)]
    with caplog.at_level("WARNING", logger="swarm.trainer.peer_finder"):
        finder._name_claims({0: stage})
        finder._name_claims({0: stage})
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        f"Not believing the throughput peer {PEERS[2]} of stage 0 announces (1e+09 samples/s): more than 16 times "
        "its stage's; it counts as 10 until timed"
    )


# --- 3. the trainer-record cap counts sound records only --------------------------------------------------------


class Item:
    def __init__(self, value, expiration: float) -> None:
        self.value, self.expiration_time = value, expiration


def trainer_value(peer: str, **changes) -> dict:
    return {**TrainerRecord(peer, "gpt-tiny", 3, 5, 80, 4.0, 10.0, 0, (), ()).to_value(), **changes}


def test_records_that_fail_validation_cannot_crowd_out_sound_ones(monkeypatch):
    monkeypatch.setattr(trainer_records, "MAX_TRAINERS", 2)
    monkeypatch.setattr(trainer_records, "ownership_problem", lambda peer, subkey, allowlist: None)
    far = get_dht_time() + 600
    flood = [(f"k{i}", Item(trainer_value(PEERS[0], loss=math.nan), far)) for i in range(50)]
    sound = [(p, Item(trainer_value(p), far - i)) for i, p in enumerate(PEERS[1:4])]
    kept = sound_trainer_records([*flood, *sound], get_dht_time())
    # past the cap, those renewed last are kept
    assert [r.peer_id for r in kept] == PEERS[1:3]


def test_a_flood_of_malformed_signed_records_on_a_real_dht_leaves_the_sound_one_read(monkeypatch):
    monkeypatch.setattr(trainer_records, "MAX_TRAINERS", 1)
    honest = TetheredDHT(start=True)
    forgers = [TetheredDHT(initial_peers=[str(m) for m in honest.get_visible_maddrs()], start=True) for _ in range(2)]
    try:
        assert publish(honest, "run", TrainerRecord.from_value(trainer_value(str(honest.peer_id)), 0.0))
        far = get_dht_time() + 600
        for forger in forgers:
            hostile = trainer_value(str(forger.peer_id), loss=math.inf)
            assert forger.store(trainer_records.trainers_key("run"), hostile, far, subkey=forger.identity.owner)
        for _ in range(3):  # whatever order the DHT lists them in
            assert [r.peer_id for r in fetch_trainer_records(honest, "run")] == [str(honest.peer_id)]
    finally:
        for dht in (*forgers, honest):
            dht.shutdown()


# --- 4. progress between stage-mates ----------------------------------------------------------------------------


def test_progress_counts_for_the_current_and_the_next_two_steps_and_within_a_bound():
    assert all(progress_refusal(step, 5, 16, 16, 8) is None for step in (5, 6, 7))
    assert progress_refusal(8, 5, 16, 16, 8) == "progress toward step 8, this peer is at step 5: only 5 to 7 count"
    bound = HELD_BATCHES * 16 + 8
    assert progress_refusal(5, 5, bound, 16, 8) is None
    assert "a mate holds at most 40" in progress_refusal(5, 5, bound + 1, 16, 8)


def stage_1_progress(serving: bool) -> tuple[StepMachine, ProgressExchange]:
    """The step machine and progress exchange of a stage-1 peer (PEERS[0]) at step 0, with no network."""
    module = build_stage(SPEC, 1, 3, seed=0)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=16)
    machine = StepMachine(runtime, PEERS[0], "gpt-tiny", FaultPlan())
    machine.serving = serving
    return machine, ProgressExchange(machine, MateMembership(machine))


def test_a_peer_keeps_its_mates_progress_ahead_of_it_until_it_gets_there():
    # a newcomer is at step 0 until its state loads: the progress its mates send meanwhile is toward their
    # step, far past its own. Refused, it would not know what a mate held there, and should that mate die,
    # nobody would find its samples lost. Kept for the latest two steps per mate, it counts once loaded.
    machine, progress = stage_1_progress(serving=False)
    mate, trainer = PEERS[1], PEERS[2]

    def send(step: int, *microbatches: int, samples: int = 2) -> MateReply:
        message = MateProgress(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=step)
        message.held.extend(SampleId(trainer=trainer, microbatch=m, samples=samples) for m in microbatches)
        reply = MateReply()
        asyncio.run(progress._answer(mate, message, [], reply))
        return reply

    assert send(7, 1).error.code == send(8, 2).error.code == send(8, 3).error.code == ErrorCode.OK
    assert send(9, 4).error.code == ErrorCode.OK  # the mate stepped meanwhile: step 7 is no longer kept
    assert "a mate holds at most" in send(9, *range(10, 30), samples=20).error.message  # the bound still holds
    assert 8 not in machine.steps and 9 not in machine.steps  # nothing counts before the state is taken
    progress.reached(8)
    assert machine.steps[8].progress[mate] == {(trainer, 2): 2, (trainer, 3): 2}
    assert machine.steps[9].progress[mate] == {(trainer, 4): 2} and 7 not in machine.steps
    # a serving peer keeps the step after next (a mate that stepped first accumulates toward it during its
    # round while this peer still applies its step) until it gets there, and refuses what is further
    machine.serving = True
    assert send(2, 5).error.code == ErrorCode.OK and 2 not in machine.steps
    assert "only 0 to 2 count" in send(3, 6).error.message
    progress.reached(1)
    assert machine.steps[2].progress[mate] == {(trainer, 5): 2}


def test_a_mate_that_dropped_microbatches_to_take_a_state_makes_this_peers_round_expect_them():
    # it asks for them again itself; should it die before the round, this peer's round finds them lost and
    # their trainers send them again, where they would otherwise be lost silently (a trust-root chaos run)
    machine, progress = stage_1_progress(serving=True)
    mate, trainer = PEERS[1], PEERS[2]
    machine.steps[0].progress[PEERS[0]] = {(trainer, 2): 2}  # this peer holds one of them itself
    message = MateProgress(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=0)
    message.dropped.extend(SampleId(trainer=trainer, microbatch=m, samples=2) for m in (1, 2))
    reply = MateReply()
    asyncio.run(progress._answer(mate, message, [], reply))
    assert reply.error.code == ErrorCode.OK
    assert machine.steps[0].lost == {(trainer, 1): 2} and machine.steps[0].dropped[mate] == {
        (trainer, 1): 2,
        (trainer, 2): 2,
    }
    assert not machine.lost(), "expected by the round, not waited for before it"
    message.dropped.extend(SampleId(trainer=trainer, microbatch=m, samples=20) for m in range(10, 30))
    assert "a mate holds at most" in asyncio.run(progress._answer(mate, message, [], MateReply()))[0].error.message


def test_a_mate_that_dropped_microbatches_it_had_said_it_held_no_longer_counts_as_holding_them():
    # its earlier progress named them: left in, they would count as held by a member, and should the mate die
    # or commit without them, no round would expect them and they would be lost silently
    machine, progress = stage_1_progress(serving=True)
    mate, trainer = PEERS[1], PEERS[2]

    def send(held: tuple[int, ...], dropped: tuple[int, ...]) -> None:
        message = MateProgress(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=0)
        message.held.extend(SampleId(trainer=trainer, microbatch=m, samples=2) for m in held)
        message.dropped.extend(SampleId(trainer=trainer, microbatch=m, samples=2) for m in dropped)
        assert asyncio.run(progress._answer(mate, message, [], MateReply()))[0].error.code == ErrorCode.OK

    send((1, 2), ())
    send((), (1, 2))
    assert machine.steps[0].progress[mate] == {} and machine.steps[0].lost == {(trainer, 1): 2, (trainer, 2): 2}
    send((2,), (1, 2))  # its trainer sent one of them to it again: it holds that one
    assert machine.steps[0].progress[mate] == {(trainer, 2): 2}


def test_a_mate_renewing_its_record_but_answering_nothing_stays_out_of_rounds():
    # any key can sign a serving record and renew it: a renewal is no sign of life, or every step's round
    # would wait for such a mate again. A message from it is one; found unreachable again, it is held out
    module = build_stage(SPEC, 1, 3, seed=0)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=16)
    membership = MateMembership(StepMachine(runtime, PEERS[0], "gpt-tiny", FaultPlan()))
    silent = PEERS[1]
    membership.take_records([record(silent, stage=1, expiration=1e12)])
    assert silent in membership.mates
    membership.mark_unreachable(silent)
    membership.take_records([record(silent, stage=1, expiration=2e12)])  # renewed
    assert silent not in membership.mates
    membership.heard_from(silent)  # it sent something: back at the next read
    membership.take_records([record(silent, stage=1, expiration=3e12)])
    assert silent in membership.mates
    membership.mark_unreachable(silent)  # a second time: held out for a while whatever it sends
    membership.heard_from(silent)
    membership.take_records([record(silent, stage=1, expiration=4e12)])
    assert silent not in membership.mates and membership.unreachable[silent] == UNREACHABLE_HOLD


def test_a_read_that_misses_a_live_mate_does_not_leave_a_liar_alone():
    # a short DHT read (a node slow to answer) must not leave an insider announcing a later step as the only
    # mate, whose state a lone answer would then confirm: a mate stays until its last record expires
    module = build_stage(SPEC, 1, 3, seed=0)
    runtime = StageRuntime(module, build_optimizer(module, OptimizerSettings()), target_batch_size=16)
    membership = MateMembership(StepMachine(runtime, PEERS[0], "gpt-tiny", FaultPlan()))
    honest, liar, lapsing = PEERS[1], PEERS[2], PEERS[3]
    now = get_dht_time()  # `lapsing`'s record has expired since it was read
    membership.take_records(
        [record(p, stage=1, expiration=now + ttl) for p, ttl in ((honest, 60), (liar, 60), (lapsing, -1))]
    )
    assert set(membership.mates) == {honest, liar, lapsing}
    membership.take_records([record(liar, stage=1, step=1000, expiration=now + 60)])  # a short read
    assert set(membership.mates) == {honest, liar}, "only the mate whose record expired is gone"
    membership.take_records([record(liar, stage=1, expiration=now + 60), record(honest, stage=1, state=JOINING)])
    assert set(membership.mates) == {liar}, "a record that says a mate no longer serves counts at once"


@pytest.mark.timeout(300)
def test_a_peer_refuses_far_future_and_inflated_progress_and_names_the_sender(local_swarm, tmp_path):
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(tmp_path / f"peer{stage}"))
    records = wait_for_records(local_swarm.initial_peers, lambda r: all(r[s] for s in range(3)))
    (target,) = records[1]
    trainer = PEERS[0]

    def progress(step: int, *held: SampleId) -> MateProgress:
        message = MateProgress(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=step)
        message.held.extend(held)
        message.samples = sum(i.samples for i in held)
        return message

    async def go(mate):
        peer = PeerID.from_base58(target.peer_id)
        replies = []
        for message in (
            progress(target.step + 1, SampleId(trainer=trainer, microbatch=1, samples=5)),  # the next step: taken
            progress(target.step + 1000, SampleId(trainer=trainer, microbatch=2, samples=5)),
            progress(target.step, *(SampleId(trainer=trainer, microbatch=m, samples=200) for m in range(10, 14))),
        ):
            reply, _ = await exchange(mate, peer, PROGRESS_PROTOCOL, [message], MateReply, WireLimits())
            replies.append(reply)
        return str(mate.peer_id), replies

    sender, (taken, future, inflated) = run_as_stage_members(local_swarm.initial_peers, 1, 1, go)
    assert taken.error.code == ErrorCode.OK, taken
    assert future.error.code == inflated.error.code == ErrorCode.BAD_REQUEST, (future, inflated)
    assert "only" in future.error.message and "a mate holds at most" in inflated.error.message
    deadline = time.monotonic() + 10
    while local_swarm.log_path("peer1").read_text().count(f"Refused progress from mate {sender}") < 2:
        assert time.monotonic() < deadline, local_swarm.log_path("peer1").read_text()[-3000:]
        time.sleep(0.2)


def test_a_newcomer_takes_the_version_most_mates_hold_then_the_most_advanced():
    a, b, c, d, e = PEERS[:5]
    crafted_ahead = {a: (4, "crafted"), b: (4, "crafted")}
    assert confirmed_holders({**crafted_ahead, c: (3, "h"), d: (3, "h"), e: (3, "h")}) == [c, d, e, a, b]
    assert confirmed_holders({**crafted_ahead, c: (3, "h"), d: (3, "h")}) == [a, b, c, d]  # a tie: ahead first
    assert confirmed_holders({**crafted_ahead, c: (3, "h"), d: (3, "h"), e: (3, "h")}, minimum_step=4) == [a, b]
    assert confirmed_holders({c: (3, "h"), d: (5, "lone")}) == []  # two answered: a version needs both


# --- 5. a request's tensors, checked before decoding ------------------------------------------------------------

SPEC = get_model_spec("gpt-tiny")
MIDDLE = build_stage(SPEC, 1, 3, seed=0)
HIDDEN = (2, SPEC.seq_len, SPEC.boundary_width)


def parts_of(*tensors: torch.Tensor, codec: str = "none") -> list[Part]:
    return [part for tensor in tensors for part in encode_tensor(tensor, get_codec(codec))]


def test_a_request_whose_headers_match_the_stage_passes_in_any_codec():
    for codec in ("none", "8bit", "fp16"):
        assert (
            undecoded_problem(MIDDLE, True, parts_of(torch.randn(HIDDEN), torch.randn(HIDDEN), codec=codec), 8) is None
        )
    first = build_stage(SPEC, 0, 3, seed=0)
    tokens = torch.randint(0, SPEC.vocab_size, HIDDEN[:2])
    assert undecoded_problem(first, False, parts_of(tokens, codec="8bit"), 8) is None


def test_a_request_announcing_shapes_beyond_the_model_is_refused_before_any_decoding(monkeypatch):
    import swarm.net.wire as wire

    monkeypatch.setattr(wire, "get_codec", lambda name: pytest.fail("decoded"))
    huge = Part(Tensor(shape=[2, SPEC.seq_len, 2**22], dtype="float32", codec="8bit", num_parts=1), b"\0" * 64)
    code, message = undecoded_problem(MIDDLE, False, [huge], 8)
    assert code == ErrorCode.BAD_REQUEST and message == (
        f"hidden must be float32[2, {SPEC.seq_len}, {SPEC.boundary_width}], got float32[2, {SPEC.seq_len}, 4194304]"
    )
    many = Part(Tensor(shape=[10**6, SPEC.seq_len, SPEC.boundary_width], dtype="float32", num_parts=1), b"")
    code, message = undecoded_problem(MIDDLE, False, [many], 8)
    assert code == ErrorCode.TOO_LARGE and "a call of 1000000 samples" in message
    # the right shape, but more bytes than such a tensor takes: a padded buffer would cost a decode
    padded = Part(Tensor(shape=list(HIDDEN), dtype="float32", codec="8bit", num_parts=1), b"\0" * (8 * 2**20))
    code, message = undecoded_problem(MIDDLE, False, [padded], 8)
    assert code == ErrorCode.BAD_REQUEST and "more than such a tensor takes" in message


@pytest.mark.parametrize(
    "tensors, backward",
    [
        ([torch.randn(HIDDEN)], True),  # a tensor short
        ([torch.randn(HIDDEN)] * 2, False),  # one too many
        ([torch.randn(HIDDEN).double()], False),  # another dtype
        ([torch.randn(HIDDEN).bfloat16()], False),  # another compute dtype: the hint names --dtype
        ([torch.randn(2, SPEC.seq_len + 1, SPEC.boundary_width)], False),  # longer than the model's sequence
        ([torch.randn(SPEC.seq_len)], False),  # no batch
    ],
)
def test_the_refusal_before_decoding_says_what_the_check_after_decoding_says(tensors, backward):
    with pytest.raises(StageInputError) as after:
        check_stage_inputs(MIDDLE, backward, tensors, 8)
    code, before = undecoded_problem(MIDDLE, backward, parts_of(*tensors), 8)
    assert code == ErrorCode.BAD_REQUEST
    assert before == str(after.value) or before.split(" of ")[0] == str(after.value).split(" of ")[0]


def test_joining_records_count_for_nothing_in_the_majority():
    # any identity may publish a joining record: three of them do not outvote two serving peers
    joining = [record(peer, state=JOINING, target_batch_size=1) for peer in PEERS[2:5]]
    assert used_settings([record(PEERS[0]), record(PEERS[1], 1), *joining], {})["target_batch_size"][0] == 16
