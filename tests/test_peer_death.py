"""A peer SIGKILLed mid-training: its backwards move to a stage-mate and its lost gradients are resent."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    TARGET,
    assert_matches_reference,
    metric_samples,
    metric_sum,
    metrics_url,
    peer_flags,
    reference_run,
    reordering_noise,
    run_p2p_client,
    trainer_flags,
    wait_for_records,
)
from hivemind.p2p import PeerID

from swarm.net.transport import get_peer_info
from swarm.peer.checkpoint import load_checkpoint
from swarm.records.sample_ledger import account, read_ledger
from swarm.records.stage_records import SERVING


def start_two_mates_and_trainer(
    local_swarm, tmp_path, steps: int, in_flight: int, *extra: str, mates: tuple[str, ...] = (), ledgers: bool = False
):
    """Stages 0 and 2 with one peer each, stage 1 with peer1a and peer1b (both with flags `mates`); a trainer
    of one-sample microbatches over 100 ms links; with `ledgers`, each writes its ledger to tmp_path/NAME.jsonl.
    Returns the trainer's process and its summary file."""
    local_swarm.start_bootstrap()
    names = {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]}
    for stage, peers in names.items():
        for name in peers:
            flags = [*(mates if stage == 1 else ()), *ledger_flag(tmp_path, name, ledgers)]
            local_swarm.start_peer(name, stage, peer_flags(tmp_path / name, *flags))
    counts = [lambda r, s=s: sum(p.state == SERVING for p in r[s]) for s in range(3)]
    wait_for_records(local_swarm.initial_peers, lambda r: [count(r) for count in counts] == [1, 2, 1])
    summary_file = tmp_path / "summary.json"
    flags = [*trainer_flags(steps, summary_file, 1, in_flight), "--emulate-latency-ms", "100", *extra]
    return local_swarm.start_trainer("trainer", [*flags, *ledger_flag(tmp_path, "trainer", ledgers)]), summary_file


def ledger_flag(tmp_path, name: str, ledgers: bool) -> list[str]:
    """`--ledger tmp_path/NAME.jsonl` where the test reads ledgers, else nothing."""
    return ["--ledger", str(tmp_path / f"{name}.jsonl")] if ledgers else []


def trainer_exit_code(local_swarm, trainer, timeout: float) -> int:
    """The trainer's exit code; a failure with the end of its log if it is still running after `timeout`."""
    try:
        return trainer.wait(timeout)
    except subprocess.TimeoutExpired:
        log = local_swarm.log_path("trainer").read_text()[-6000:]
        pytest.fail(f"the trainer still runs after {timeout:.0f}s:\n{log}")


@pytest.mark.timeout(300)
def test_killed_peer_loses_no_microbatch(local_swarm, tmp_path):
    steps, micro, kill_at, in_flight = 12, 1, 2, 8  # steps enough that a loaded machine still sees peer1a hold 2
    # one sample per microbatch, many in flight, 100 ms each way: a kill lands between forwards and backwards
    trainer, summary_file = start_two_mates_and_trainer(
        local_swarm, tmp_path, steps, in_flight, mates=("--metrics-port", "0")
    )
    urls = {name: metrics_url(local_swarm, name) for name in ("peer1a", "peer1b")}
    # one mate is killed while it holds backwards it answered and has not averaged: a few accumulated toward a
    # step (their replies went out first), and the rest of the step (backwards and a round) still to come.
    # Whichever mate it is: the router may give one of them most of the calls (the earliest to finish wins).
    # The trainer is paused meanwhile, so however late the kill lands, the round it must precede cannot begin
    try:
        victim = peer_holding_answered_backwards(local_swarm, urls, kill_at, in_flight)
        local_swarm.stop(victim, signal.SIGKILL)
    finally:
        local_swarm.signal("trainer", signal.SIGCONT)
    survivor = "peer1b" if victim == "peer1a" else "peer1a"

    assert trainer_exit_code(local_swarm, trainer, 240) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == steps
    assert summary["backwards_moved"] > 0, "no backward had to move to the surviving stage-mate"
    assert summary["samples_resent"] > 0, "the dead peer held no gradients: the kill came at a step boundary"
    for name in ("peer0", survivor, "peer2"):
        assert local_swarm.stop(name) == 0
    # what the dead peer had applied was sent again: the stage ends as the one-process run does
    checkpoint = load_checkpoint(tmp_path / survivor, "gpt-tiny", 1, 3)
    assert checkpoint.step == steps and checkpoint.samples_stepped == steps * 24
    noise = reordering_noise(steps, 1, micro)
    assert_matches_reference(reference_run(steps, micro).stages[1], checkpoint.parameters, "stage 1", noise)


def peer_holding_answered_backwards(local_swarm, urls: dict[str, str], from_step: int, in_flight: int) -> str:
    """The first of the peers at `urls` (stage-mates) seen, at `from_step` or later, holding 2 samples it answered
    while the step has half its samples still to come; returns with the trainer paused (SIGSTOP), the caller
    resumes it. Answered, not only summed: a backward killed between its sum and its reply fails over to the
    mate, nothing to resend. Half to come, read once the trainer is paused: only its `in_flight` one-sample
    microbatches can still land, too few to fill the step, so no round takes the gradients before the kill,
    however long this process is held up (a loaded machine)."""
    assert in_flight < TARGET // 2
    trainer = local_swarm.processes["trainer"]
    at_step: dict[str, tuple[float, float]] = {}  # per peer: its step, and its backward samples answered before it
    deadline = time.monotonic() + 150
    while True:
        assert time.monotonic() < deadline and trainer.poll() is None, "no stage-1 peer held 2 answered samples"
        if holding_answered(urls, from_step, at_step) is not None:
            pause(local_swarm, "trainer")
            if (victim := holding_answered(urls, from_step, at_step)) is not None:
                return victim
            local_swarm.signal("trainer", signal.SIGCONT)
        time.sleep(0.05)


def holding_answered(urls: dict[str, str], from_step: int, at_step: dict[str, tuple[float, float]]) -> str | None:
    """From one read of each peer's metrics: the first at `from_step` or later that answered 2 backward samples of
    its step and holds them, while the stage holds at most half its batch, if any. `at_step` (updated) keeps each
    peer's step as last read, and the backward samples it had answered when it was first read at that step."""
    read = {name: peer_counts(url) for name, url in urls.items()}
    for name, (step, answered, _) in read.items():
        if at_step.get(name, (None,))[0] != step:
            at_step[name] = (step, answered)
    steps = {step for step, _, _ in read.values()}
    if len(steps) > 1 or sum(held for _, _, held in read.values()) > TARGET // 2:
        return None  # a round under way, or one that a few more backwards start
    for name, (step, answered, held) in read.items():
        if step >= from_step and held >= 2 and answered - at_step[name][1] >= 2:
            return name
    return None


def pause(local_swarm, name: str, timeout: float = 10.0) -> None:
    """Stops process `name` (SIGSTOP) and waits until the kernel shows it stopped."""
    local_swarm.signal(name, signal.SIGSTOP)
    stat = Path(f"/proc/{local_swarm.processes[name].pid}/stat")
    deadline = time.monotonic() + timeout
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"{name} did not stop within {timeout:.0f}s"
        time.sleep(0.01)


def peer_counts(url: str) -> tuple[float, float, float]:
    """A peer's step, backward samples answered, and samples held toward its step, from one metrics read."""
    samples = metric_samples(url)
    answered = metric_sum(samples, "swarm_peer_samples_total", kind="backward")
    return metric_sum(samples, "swarm_peer_step"), answered, metric_sum(samples, "swarm_peer_samples_accumulated")


@pytest.mark.timeout(300)
def test_a_backward_is_answered_only_once_the_stage_mates_count_it(local_swarm, tmp_path):
    # stage 1: B is frozen (its daemon too) at a step boundary, so the progress A sends it hangs; A takes
    # backwards and dies within the progress timeout. Had A answered them, the trainer would count them
    # done, and should B never hear of them it would wait forever for a batch the trainer believes
    # complete. Unanswered, they fail over to B like any call to a dead peer: nothing has to be resent
    steps = 4
    trainer, summary_file = start_two_mates_and_trainer(local_swarm, tmp_path, steps, 4, "--stage-wait-timeout", "60")
    wait_for_records(local_swarm.initial_peers, lambda r: any(p.step >= 1 for p in r[1]), timeout=150)
    for _ in range(30):  # pause the trainer between steps: A holds no sample of the step to come
        local_swarm.signal("trainer", signal.SIGSTOP)
        time.sleep(1.5)  # calls already out land
        if accumulated(local_swarm, ["peer1a"])[0] == [0]:
            break
        local_swarm.signal("trainer", signal.SIGCONT)
        time.sleep(random.uniform(0.2, 1.0))
    else:
        pytest.fail("never caught peer1a between steps")
    frozen = local_swarm.processes["peer1b"].pid
    try:
        os.killpg(frozen, signal.SIGSTOP)
        local_swarm.signal("trainer", signal.SIGCONT)
        time.sleep(2.5)  # the step's first backwards reach A; its progress to B hangs (timeout: 5 s)
        local_swarm.stop("peer1a", signal.SIGKILL)
    finally:
        os.killpg(frozen, signal.SIGCONT)
        local_swarm.signal("trainer", signal.SIGCONT)

    assert trainer_exit_code(local_swarm, trainer, 200) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == steps
    assert summary["backwards_moved"] > 0, "peer1a held no unanswered backward when it died"
    assert summary["samples_resent"] == 0, "peer1a answered backwards its mate had not heard of"
    for name in ("peer0", "peer1b", "peer2"):
        assert local_swarm.stop(name) == 0
    checkpoint = load_checkpoint(tmp_path / "peer1b", "gpt-tiny", 1, 3)
    assert checkpoint.step == steps and checkpoint.samples_stepped == steps * TARGET


def peer_id_of(local_swarm, name: str) -> str:
    return re.search(r"peer id (\w+)", local_swarm.log_path(name).read_text()).group(1)


def accumulated(local_swarm, names: list[str]) -> tuple[list[int], bool]:
    """Samples each named peer holds toward its stage's next step, asked over the wire, and whether every one of
    them is idle: nothing queued, no round under way (what it holds can change only by a call still landing)."""

    async def ask(p2p) -> tuple[list[int], bool]:
        infos = [await get_peer_info(p2p, PeerID.from_base58(peer_id_of(local_swarm, n))) for n in names]
        idle = all(info.queue_length == 0 and info.step_state == "accumulating" for info in infos)
        return [info.samples_accumulated for info in infos], idle

    return run_p2p_client(local_swarm.initial_peers, ask)


def settled_holdings(local_swarm, names: list[str], reads: int = 12) -> list[int] | None:
    """What each named peer holds once two reads half a second apart agree with every peer idle (the calls a paused
    trainer had out have landed: on a loaded machine they take seconds, and one landing after a read filled the
    batch, so the peer to die stepped on what it was counted holding); None if they never settle."""
    last = None
    for _ in range(reads):
        held, idle = accumulated(local_swarm, names)
        if idle and held == last:
            return held
        last = held if idle else None
        time.sleep(0.5)
    return None


@pytest.mark.timeout(300)
def test_newcomer_learns_samples_lost_with_a_mate_that_died_before_it_joined(local_swarm, tmp_path):
    # stage 1: A holds samples of a step; A dies; C joins from its mate B; B dies. Only C is left, and only
    # B's word tells it that A held samples: without it, C would wait for a batch that never fills
    steps = 4
    trainer, summary_file = start_two_mates_and_trainer(
        local_swarm, tmp_path, steps, 4, "--stage-wait-timeout", "60", ledgers=True
    )
    wait_for_records(local_swarm.initial_peers, lambda r: any(p.step >= 1 for p in r[1]), timeout=150)
    # pause the trainer at a moment a stage-1 peer holds samples of an unfinished step; routing decides which
    # (a loaded machine may give one peer nearly all of them), so the one that holds some is the one to die
    for _ in range(20):
        local_swarm.signal("trainer", signal.SIGSTOP)
        held = settled_holdings(local_swarm, ["peer0", "peer1a", "peer1b", "peer2"])
        if held is not None and max(held[1:3]) > 0:
            held = held[1:3]
            break
        local_swarm.signal("trainer", signal.SIGCONT)
        time.sleep(1)
    else:
        pytest.fail("no stage-1 peer held samples while the trainer was paused")
    dying, mate = ("peer1a", "peer1b") if held[0] > 0 else ("peer1b", "peer1a")
    try:
        local_swarm.stop(dying, signal.SIGKILL)
        local_swarm.start_peer("peer1c", 1, peer_flags(tmp_path / "peer1c", *ledger_flag(tmp_path, "peer1c", True)))
        newcomer = peer_id_of_when_serving(local_swarm, "peer1c")
        wait_for_records(local_swarm.initial_peers, lambda r: any(p.peer_id == newcomer for p in r[1]))
        local_swarm.stop(mate, signal.SIGKILL)
    finally:
        local_swarm.signal("trainer", signal.SIGCONT)

    assert trainer_exit_code(local_swarm, trainer, 200) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == steps
    # what the dead peer held comes back (only its mate's word told the newcomer of it); what the mate held too
    # comes back where the mate told the newcomer before it died
    assert summary["samples_resent"] >= held[0 if dying == "peer1a" else 1], summary
    assert "died holding" in local_swarm.log_path("peer1c").read_text()
    # and by id, every sample fed was stepped once at every stage: none lost, silently or not, none twice
    report = account(read_ledger(tmp_path / "trainer.jsonl"), read_ledger(tmp_path.glob("peer*.jsonl")))
    assert report["totals"]["samples_fed"] == steps * TARGET, report["totals"]
    for name in ("samples_lost", "samples_silently_lost", "samples_doubled", "samples_orphaned"):
        assert report["totals"][name] == 0, report["totals"]
    for name in ("peer0", "peer1c", "peer2"):
        assert local_swarm.stop(name) == 0
    checkpoint = load_checkpoint(tmp_path / "peer1c", "gpt-tiny", 1, 3)
    assert checkpoint.step == steps and checkpoint.samples_stepped == steps * TARGET


def peer_id_of_when_serving(local_swarm, name: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not re.search(r"Serving stage .* peer id (\w+)", local_swarm.log_path(name).read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{name} never served"
        assert local_swarm.processes[name].poll() is None, f"{name} exited"
        time.sleep(0.3)
    return peer_id_of(local_swarm, name)
