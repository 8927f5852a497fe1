"""The step protocol under faults injected at named points: nothing counted twice, losses counted by id,
replicas that differ caught, several trainers on one swarm, a trainer that dies replaced."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter

import pytest
import torch
from conftest import (
    assert_matches_reference,
    peer_flags,
    reference_run,
    reordering_noise,
    run_as_stage_members,
    run_p2p_client,
    trainer_flags,
    wait_for_records,
)
from hivemind.p2p import PeerID
from test_peer_death import trainer_exit_code

from swarm.compression import get_codec
from swarm.net.transport import PROGRESS_PROTOCOL, StageCallError, call_stage, exchange, get_peer_info
from swarm.net.wire import WireLimits
from swarm.peer.checkpoint import load_checkpoint
from swarm.peer.state_transfer import request_state
from swarm.proto import FORWARD, PROTOCOL_VERSION, ErrorCode, MateProgress, MateReply, SampleId, StageRequest
from swarm.records.stage_records import SERVING

# a stage-mate that reports (and runs at) 10 samples/s, against some hundreds for a peer at CPU speed
SLOW_MATE = ["--simulated-speed", "10"]


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_lines(path) -> list[dict]:
    """A peer ledger's step lines (it also holds restore and left lines, which sum nothing)."""
    return [line for line in read_lines(path) if line["kind"] == "step"]


def start_swarm(local_swarm, tmp_path, layout: dict[int, list[str]], extra: dict[str, list[str]] | None = None) -> None:
    """Peers named in `layout` (stage -> names), each with a ledger NAME.ledger and its `extra` flags."""
    local_swarm.start_bootstrap()
    for stage, names in layout.items():
        for name in names:
            own = (extra or {}).get(name, [])
            flags = peer_flags(tmp_path / name, "--ledger", str(tmp_path / f"{name}.ledger"), *own)
            local_swarm.start_peer(name, stage, flags)
    wanted = [len(layout[s]) for s in range(3)]
    wait_for_records(
        local_swarm.initial_peers, lambda r: [sum(p.state == SERVING for p in r[s]) for s in range(3)] == wanted
    )


def peer_infos(local_swarm, stage: int) -> list:
    """PeerInfo of every serving peer of `stage` that answers."""
    records = wait_for_records(local_swarm.initial_peers, lambda r: bool(r[stage]))[stage]
    ids = [r.peer_id for r in records if r.state == SERVING]

    async def ask(p2p):
        infos = []
        for peer_id in ids:
            try:
                infos.append(await get_peer_info(p2p, PeerID.from_base58(peer_id)))
            except StageCallError:  # a dead peer's record outlives it by up to its time to live
                continue
        return infos

    return run_p2p_client(local_swarm.initial_peers, ask)


@pytest.mark.timeout(300)
def test_a_backward_finished_after_its_caller_gave_up_is_not_applied(local_swarm, tmp_path):
    """peer1b takes 6 s over its first backward, past the trainer's 4 s deadline: the trainer sends it to
    peer1a, and peer1b must drop its late gradient; the swarm still matches one process exactly."""
    steps = 4
    start_swarm(
        local_swarm,
        tmp_path,
        {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]},
        # peer1a as a slow device: the router sends peer1b nearly every call, so its fault fires
        {"peer1b": ["--faults", "before_commit@1=delay:6"], "peer1a": SLOW_MATE},
    )
    summary_file = tmp_path / "summary.json"
    flags = [*trainer_flags(steps, summary_file), "--call-timeout", "4", "--call-timeout-floor", "4"]
    trainer = local_swarm.start_trainer("trainer", flags)
    assert trainer_exit_code(local_swarm, trainer, 200) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    infos = peer_infos(local_swarm, 1)
    assert sum(i.abandoned_calls for i in infos) >= 1, infos  # the late backward was dropped, not applied
    assert sum(i.samples_doubled for i in infos) == 0, infos
    local_swarm.stop_all()
    reference = reference_run(steps)
    for stage, name in [(0, "peer0"), (1, "peer1a"), (2, "peer2")]:
        checkpoint = load_checkpoint(tmp_path / name, "gpt-tiny", stage, 3)
        assert checkpoint.step == steps
        assert_matches_reference(
            reference.stages[stage], checkpoint.parameters, f"stage {stage}", reordering_noise(steps, stage)
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "faults", ["after_backward@2=drop_reply", "after_backward@2=delay:5,after_backward@2=drop_reply"]
)
def test_a_backward_whose_reply_was_lost_is_summed_once_by_the_stage(local_swarm, tmp_path, faults):
    """peer1b applies its second backward and tells its mate, but the trainer never gets the reply (at once,
    or after 5 s, past the trainer's deadline, when the stage may have stepped on it): the trainer sends it
    to peer1a, which answers it without summing it again. Every stage sums every fed microbatch exactly
    once, and the replicas of stage 1 end identical. (Not bit for bit one process's run: a retry answered
    after its stage stepped carries a gradient of the newer parameters upstream, as a stale one does.)"""
    steps = 4
    layout = {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]}
    # peer1a as a slow device: the router sends peer1b nearly every call, so its second backward comes
    start_swarm(local_swarm, tmp_path, layout, {"peer1b": ["--faults", faults], "peer1a": SLOW_MATE})
    summary_file = tmp_path / "summary.json"
    ledger = tmp_path / "trainer.ledger"
    flags = [*trainer_flags(steps, summary_file), "--call-timeout", "4", "--call-timeout-floor", "4"]
    trainer = local_swarm.start_trainer("trainer", [*flags, "--ledger", str(ledger)])
    assert trainer_exit_code(local_swarm, trainer, 200) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    infos = peer_infos(local_swarm, 1)
    assert sum(i.duplicate_backwards for i in infos) >= 1, infos  # the retry came and was not summed
    assert sum(i.samples_doubled for i in infos) == 0, infos
    assert len({(i.step, i.fingerprint) for i in infos}) == 1, infos
    local_swarm.stop_all()
    fed = {(line["trainer"], line["mb"]) for line in read_lines(ledger) if line["kind"] == "fed"}
    for stage, summed in summed_per_stage(tmp_path, {0: "peer0", 1: "peer1a", 2: "peer2"}).items():
        assert set(summed.values()) == {1}, f"stage {stage} summed a microbatch twice: {summed}"
        assert set(summed) == fed, f"stage {stage} summed other microbatches than were fed"
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == steps and summary["last_loss"] < summary["first_loss"], summary


@pytest.mark.timeout(300)
def test_a_given_state_names_the_microbatches_its_last_rounds_summed(local_swarm, tmp_path):
    """A peer that takes a mate's state takes the ids of what it already sums: a retry of one of them (its
    reply lost before the newcomer joined, or sent again because the newcomer counted it lost while its
    mate had stepped on it) is then answered without summing it twice."""
    local_swarm.start_bootstrap()
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, peer_flags(tmp_path / f"peer{stage}"))
    trainer = local_swarm.start_trainer("trainer", trainer_flags(2, tmp_path / "summary.json"))
    assert trainer_exit_code(local_swarm, trainer, 180) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    records = wait_for_records(local_swarm.initial_peers, lambda r: all(p.step == 2 for p in r[1]))
    (record,) = records[1]
    given = run_as_stage_members(
        local_swarm.initial_peers, 1, 1, lambda p2p: request_state(p2p, record.peer_id, "gpt-tiny", 1, WireLimits())
    )
    assert given.step == 2
    # 2 steps of 24 samples in microbatches of 5: 5 microbatches a step, all of one trainer
    assert len(given.recently_summed) == 10 and len({trainer for trainer, _ in given.recently_summed}) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("resend_buffer_mb", ["0", "64"])
def test_samples_that_die_with_a_peer_are_resent_or_counted_lost_by_id(local_swarm, tmp_path, resend_buffer_mb):
    """peer1a dies on the spot as its first round starts, holding the backwards it answered. With a
    resend buffer the trainer sends it again and nothing is lost; without one (a restarted trainer) the
    stage waits --short-wait, steps without it and counts it as lost, by id."""
    steps = 4
    start_swarm(
        local_swarm,
        tmp_path,
        {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]},
        {
            "peer1a": ["--faults", "before_contribution@1=die", "--short-wait", "3"],
            # slow, so that the router gives peer1a backwards: a loaded machine once had peer1a measured the
            # slower of two equals, given none, and never reaching its fault
            "peer1b": ["--short-wait", "3", *SLOW_MATE],
        },
    )
    summary_file = tmp_path / "summary.json"
    ledger = tmp_path / "trainer.ledger"
    flags = [
        *trainer_flags(steps, summary_file, microbatch_size=1, in_flight=8),
        "--emulate-latency-ms", "50", "--resend-buffer-mb", resend_buffer_mb, "--ledger", str(ledger),
    ]  # fmt: skip
    trainer = local_swarm.start_trainer("trainer", flags)
    assert trainer_exit_code(local_swarm, trainer, 240) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    wait_for_records(local_swarm.initial_peers, lambda r: any(p.step >= steps for p in r[1]))
    (survivor,) = peer_infos(local_swarm, 1)
    lost_lines = [entry for line in step_lines(tmp_path / "peer1b.ledger") for entry in line["lost"]]
    if resend_buffer_mb == "0":
        assert survivor.samples_lost >= 1, survivor
        assert sum(n for _, _, n in lost_lines) == survivor.samples_lost
        # the trainer was asked for them and no longer held them (it may also have been asked for one whose
        # retry was still on its way: the stage's count is the exact one)
        assert summary["lost_not_held"] >= survivor.samples_lost
        fed = {(line["trainer"], line["mb"]) for line in read_lines(ledger)}
        assert {(t, mb) for t, mb, _ in lost_lines} <= fed  # named by id: microbatches the trainer fed
    else:
        assert survivor.samples_lost == 0 and not lost_lines, survivor
        assert summary["settled"] and summary["samples_resent"] >= 1, summary
        local_swarm.stop_all()
        reference = reference_run(steps, microbatch_size=1)
        checkpoint = load_checkpoint(tmp_path / "peer1b", "gpt-tiny", 1, 3)
        assert_matches_reference(reference.stages[1], checkpoint.parameters, "stage 1", (4e-4, 3e-6))


@pytest.mark.timeout(300)
def test_samples_lost_after_a_trainers_last_step_are_sent_again_before_it_exits(local_swarm, tmp_path):
    """peer1a dies on the spot as the round of the trainer's last step starts, holding backwards of that
    step. The trainer has had every backward answered, yet it does not exit until stage 1 steps past its
    last step: it hears that the stage is short, sends them again, and the stage loses nothing."""
    steps = 1  # one step: its round is the trainer's last, and the first where peer1a holds samples
    start_swarm(
        local_swarm,
        tmp_path,
        {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]},
        {
            # a long wait: without the resend the stage would step short long after the trainer exited
            "peer1a": ["--faults", "before_contribution@1=die", "--short-wait", "60"],
            # slow, so that peer1a takes the backwards: one that held none (measured the slower of two equal
            # peers on a loaded machine) had nothing to lose and never reached its fault
            "peer1b": ["--short-wait", "60", *SLOW_MATE],
        },
    )
    summary_file = tmp_path / "summary.json"
    flags = [*trainer_flags(steps, summary_file, microbatch_size=1, in_flight=8), "--emulate-latency-ms", "50"]
    trainer = local_swarm.start_trainer("trainer", flags)
    assert trainer_exit_code(local_swarm, trainer, 240) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["settled"] and summary["samples_resent"] >= 1, summary
    # the trainer exited only after the stage stepped: no wait on records for it
    (survivor,) = peer_infos(local_swarm, 1)
    assert survivor.step == steps and survivor.samples_lost == 0, survivor
    assert not [entry for line in step_lines(tmp_path / "peer1b.ledger") for entry in line["lost"]]
    local_swarm.stop_all()
    reference = reference_run(steps, microbatch_size=1)
    checkpoint = load_checkpoint(tmp_path / "peer1b", "gpt-tiny", 1, 3)
    assert_matches_reference(reference.stages[1], checkpoint.parameters, "stage 1", (4e-4, 3e-6))


@pytest.mark.timeout(300)
def test_a_replica_that_differs_from_its_mates_takes_their_state(local_swarm, tmp_path):
    """peer1a's parameters are nudged after its second step: its mates' fingerprints outvote it, it says so
    and takes their state, and the three replicas end identical."""
    names = ["peer1a", "peer1b", "peer1c"]
    start_swarm(
        local_swarm, tmp_path, {0: ["peer0"], 1: names, 2: ["peer2"]}, {"peer1a": ["--faults", "after_step@2=perturb"]}
    )
    trainer = local_swarm.start_trainer("trainer", trainer_flags(8, tmp_path / "summary.json"))
    assert trainer_exit_code(local_swarm, trainer, 240) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    assert "differ from" in local_swarm.log_path("peer1a").read_text()
    deadline = time.monotonic() + 60
    while True:  # the last step's round may still be finishing: wait until the replicas are at one step
        infos = peer_infos(local_swarm, 1)
        if len({(i.step, i.fingerprint) for i in infos}) == 1 and len(infos) == 3:
            break
        assert time.monotonic() < deadline, [(i.step, i.fingerprint, i.divergences) for i in infos]
        time.sleep(0.5)
    assert sum(i.divergences for i in infos) == 1, infos


def summed_per_stage(tmp_path, names: dict[int, str]) -> dict[int, Counter]:
    """Per stage, how many times each (trainer, microbatch) was summed into a step (one replica's ledger)."""
    return {
        stage: Counter((t, mb) for line in step_lines(tmp_path / f"{name}.ledger") for t, mb, _ in line["ids"])
        for stage, name in names.items()
    }


@pytest.mark.timeout(300)
def test_two_trainers_train_one_model_and_stale_backwards_go_again_at_the_current_step(local_swarm, tmp_path):
    """Two trainers, each with its own data, on one peer per stage that refuses any stale gradient: both
    finish and lower the loss; a refused backward is sent again at the stage's current step, so no
    microbatch is summed twice at any stage and none is summed that was not fed."""
    names = {0: "peer0", 1: "peer1", 2: "peer2"}
    start_swarm(
        local_swarm,
        tmp_path,
        {stage: [name] for stage, name in names.items()},
        {name: ["--max-staleness", "0"] for name in names.values()},
    )
    trainers = {}
    for index in range(2):
        flags = [
            *trainer_flags(10, tmp_path / f"summary{index}.json"),
            "--data-seed", str(100 + index), "--ledger", str(tmp_path / f"trainer{index}.ledger"),
        ]  # fmt: skip
        trainers[index] = local_swarm.start_trainer(f"trainer{index}", flags)
    for index, trainer in trainers.items():
        assert trainer.wait(240) == 0, local_swarm.log_path(f"trainer{index}").read_text()[-3000:]
    summaries = [json.loads((tmp_path / f"summary{i}.json").read_text()) for i in trainers]
    for summary in summaries:
        assert summary["steps"] == 10 and summary["last_loss"] < summary["first_loss"], summary
    assert sum(s["stale_resent"] for s in summaries) >= 1, summaries
    fed = Counter(
        (line["trainer"], line["mb"]) for i in trainers for line in read_lines(tmp_path / f"trainer{i}.ledger")
    )
    assert len(fed) == 2 * 10 * 5 and set(fed.values()) == {1}
    for stage, summed in summed_per_stage(tmp_path, names).items():
        assert set(summed.values()) <= {1}, f"stage {stage} summed a microbatch twice"
        assert set(summed) <= set(fed), f"stage {stage} summed a microbatch no trainer finished"


@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_step_costs_only_its_microbatches_in_flight(local_swarm, tmp_path):
    """A trainer SIGKILLed in the middle of a step, then a new one: the new one trains within 60 s."""
    start_swarm(local_swarm, tmp_path, {0: ["peer0"], 1: ["peer1"], 2: ["peer2"]})
    first_ledger = tmp_path / "first.ledger"
    flags = [*trainer_flags(1000, tmp_path / "first.json"), "--ledger", str(first_ledger)]
    local_swarm.start_trainer("trainer-first", flags)
    deadline = time.monotonic() + 120
    while len(read_lines(first_ledger)) < 12:  # two steps and a bit: mid-step
        assert time.monotonic() < deadline, local_swarm.log_path("trainer-first").read_text()[-3000:]
        time.sleep(0.1)
    local_swarm.stop("trainer-first", signal.SIGKILL)
    killed_at = time.monotonic()
    summary_file = tmp_path / "second.json"
    second = local_swarm.start_trainer("trainer-second", trainer_flags(3, summary_file))
    assert second.wait(90) == 0, local_swarm.log_path("trainer-second").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 3
    assert time.monotonic() - killed_at < 90


@pytest.mark.timeout(300)
def test_progress_that_arrives_out_of_order_does_not_make_a_peer_forget_what_its_mate_held(local_swarm, tmp_path):
    """Mate X's progress names microbatches A and B, then an older message naming A alone arrives last; mate Y
    holds C. A, B and C fill the stage's batch. Both "mates" then serve no round: the peer must count A, B and C
    lost and ask for them. With progress replaced instead of merged, it forgot B: it saw no full batch and
    would have stepped later without B, which was lost silently."""
    start_swarm(local_swarm, tmp_path, {0: ["peer0"], 1: ["peer1"], 2: ["peer2"]})
    (record,) = wait_for_records(local_swarm.initial_peers, lambda r: bool(r[1]))[1]
    trainer = "12D3KooWHC2fW5dayrHQFixWeqLUbXSpBFYcsCEGbpuJWffMLvEE"
    a, b, c = (SampleId(trainer=trainer, microbatch=mb, samples=8) for mb in (1, 2, 3))  # 24: the target batch

    def progress(*held: SampleId) -> MateProgress:
        message = MateProgress(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, step=record.step)
        message.held.extend(held)
        message.samples = sum(i.samples for i in held)
        return message

    async def go(x, y):  # two peers with signed records on stage 1: mates
        peer = PeerID.from_base58(record.peer_id)
        for sender, message in ((x, progress(a, b)), (x, progress(a)), (y, progress(c))):
            reply, _ = await exchange(sender, peer, PROGRESS_PROTOCOL, [message], MateReply, WireLimits())
            assert reply.error.code == ErrorCode.OK, reply
        request = StageRequest(kind=FORWARD, model="gpt-tiny", stage=1, step=record.step + 1)
        with pytest.raises(StageCallError) as info:
            await call_stage(x, peer, request, [torch.randn(2, 64, 128)], get_codec("none"), timeout=60)
        return info.value

    error = run_as_stage_members(local_swarm.initial_peers, 1, 2, go)
    assert error.code == ErrorCode.SHORT, error
    assert sorted(i.microbatch for i in error.reply.lost) == [1, 2, 3], error.reply
