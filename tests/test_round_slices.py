"""The averaging round's slices: the pure parts (cuts, sums, bounds), and real swarms whose mates die
between the agreement and the last slice."""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_matches_reference, reference_run, trainer_flags, wait_for_records
from test_peer_death import trainer_exit_code
from test_step_protocol import peer_infos, start_swarm, step_lines

from swarm.compression import get_codec
from swarm.net.wire import WireLimits, decode_tensors
from swarm.peer.checkpoint import load_checkpoint
from swarm.peer.contribution_bounds import CLIP_FACTOR
from swarm.peer.round_slices import (
    SliceMessage,
    contributors_digest,
    owner_scales,
    reduce_slice,
    slice_bounds,
    slice_length,
    slice_owners,
)
from swarm.peer.slice_exchange import SliceExchange
from swarm.peer.step_machine import StepState
from swarm.proto import PROTOCOL_VERSION, ErrorCode, MateReply, RoundSlice, SliceKind

# a mate dropped in the round, not at its timeout
DROPPED = re.compile(r"mate \S+ is (gone|unreachable) \(")


@pytest.mark.parametrize(("size", "count"), [(10, 3), (7, 7), (5, 8), (1_000_003, 16)])
def test_slices_cover_the_vector_once_and_evenly(size, count):
    bounds = slice_bounds(size, count)
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == [slice_length(size, count, i) for i in range(count)]


def test_summing_by_slices_gives_the_bits_of_summing_whole_gradients():
    torch.manual_seed(0)
    grads = [torch.randn(100_003) * 10 ** (i % 3) for i in range(6)]
    whole = grads[0].clone()
    for grad in grads[1:]:
        whole.add_(grad)
    by_slices = torch.cat(
        [reduce_slice([g[lo:hi] for g in grads], [1.0] * len(grads)) for lo, hi in slice_bounds(100_003, 5)]
    )
    assert torch.equal(whole, by_slices)


def test_owners_leave_out_handovers_and_digests_name_the_round():
    assert slice_owners(["c", "a", "b"], {"b"}) == ["a", "c"]
    digest = contributors_digest(3, 0, ["a", "b"])
    assert digest == contributors_digest(3, 0, ["b", "a"])
    assert len({digest, contributors_digest(3, 1, ["a", "b"]), contributors_digest(4, 0, ["a", "b"])}) == 3
    assert digest != contributors_digest(3, 0, ["a", "c"])


def test_an_understated_norm_is_bounded_by_what_its_slice_shows():
    samples = [10, 10, 10]
    # honest statements: the bound rests on them, nothing is clipped
    assert owner_scales([1.0, 1.2, 0.9], [0.5, 0.6, 0.4], samples) == [1.0, 1.0, 1.0]
    # the third states 1.0 but its slice alone holds 100: its slice is scaled down to the group's bound
    scales = owner_scales([1.0, 1.2, 1.0], [0.5, 0.6, 100.0], samples)
    assert scales[:2] == [1.0, 1.0] and scales[2] == pytest.approx(CLIP_FACTOR * 1.2 / 100.0)  # the lower median: 1.2


def test_a_mate_asked_for_a_dead_owners_sum_answers_with_the_one_it_received_before_its_gather_ended():
    """A CI run: an owner died right after sending its sum to one mate; the other mate, refused the dial when it sent
    the owner its own sum, asked the first for that sum at once, before the first had gathered every slice and kept
    them, was told it had none, and failed the round that the first then stepped on without it."""
    owners = ["peerA", "peerB", "peerC"]  # peerA died; this peer is peerB; peerC asks for slice 0
    digest = contributors_digest(5, 0, owners)
    machine = SimpleNamespace(limits=WireLimits(), steps=defaultdict(StepState), runtime=SimpleNamespace(step=5))
    exchange = SliceExchange(machine, None, get_codec("none"), averaging_timeout=1.0, waiting=None)
    exchange.owners[(5, 0, digest)] = owners
    inbox = machine.steps[5].inbox[0]
    inbox.reduced["peerA"] = SliceMessage(digest, 3, 0, torch.arange(4.0))  # the owner's own sum of slice 0
    inbox.reduced["peerC"] = SliceMessage(digest, 3, 1, torch.zeros(4))  # not slice 1's owner: never handed on

    def fetch(index: int, count: int = 3, step: int = 5) -> tuple[int, list]:
        kind = SliceKind.FETCH
        ask = RoundSlice(protocol_version=PROTOCOL_VERSION, step=step, kind=kind, index=index, count=count)
        ask.contributors = digest
        answer = exchange._fetched(ask, MateReply(protocol_version=PROTOCOL_VERSION, step=5))
        header = getattr(answer[0], "message", answer[0])  # frames with a tensor, or the bare reply
        return header.error.code, [part for frame in answer for part in getattr(frame, "parts", [])]

    code, parts = fetch(0)
    assert code == ErrorCode.OK and torch.equal(decode_tensors(parts, WireLimits())[0], torch.arange(4.0))
    for index, count, step in ((1, 3, 5), (0, 2, 5), (0, 3, 6)):  # a sender not the owner, another round, step
        assert fetch(index, count, step)[0] == ErrorCode.UNAVAILABLE
    assert 6 not in machine.steps, "an ask for a step this peer never saw leaves no state behind"


def test_a_member_that_fetched_a_dead_owners_sum_still_waits_for_a_live_owner_that_is_late():
    """A CI run: an owner died right after sending its sum to one mate; that mate, held sending its own sum to the
    dead owner first, was late with it to the other. The other, its slices refused by the dead owner, gave the wait
    up at once, asked the dead owner (the only other member) for the late one's sum, and failed the round that
    the late one then stepped on without it."""
    owners = ["peerA", "peerD", "peerC"]  # this peer is peerC; peerD died; peerA is alive and late
    digest = contributors_digest(5, 0, owners)

    async def gather() -> dict[int, torch.Tensor]:
        loop = asyncio.get_running_loop()
        machine = SimpleNamespace(
            limits=WireLimits(),
            steps=defaultdict(StepState),
            runtime=SimpleNamespace(step=5),
            stage=1,
            loop=loop,
            changed=asyncio.Event(),
            check_left_behind=lambda step: None,
            peer_id="peerC",
        )
        waiting = SimpleNamespace(probe_late=lambda *args: None, wait_for=lambda missing, started: 10.0)
        exchange = SliceExchange(machine, None, get_codec("none"), averaging_timeout=1.0, waiting=waiting)
        exchange.kept[(5, 0, digest)] = {2: torch.full((2,), 2.0)}
        exchange.unsent[(5, 0)] = {"peerD"}  # this peer's sum could not reach peerD: it refused the dial

        async def fetch(step, attempt, digest, index, count, owners):  # peerA holds what peerD sent it
            return torch.full((2,), 1.0) if owners[index] == "peerD" else None

        exchange._fetch = fetch
        state = machine.steps[5]

        def late_sum() -> None:
            state.inbox[0].reduced["peerA"] = SliceMessage(digest, 3, 0, torch.zeros(2))
            machine.changed.set()

        loop.call_later(0.3, late_sum)
        return await exchange._gather(5, 0, state, owners, slice_bounds(6, 3), digest)

    pieces = asyncio.run(asyncio.wait_for(gather(), 30))
    assert [pieces[i].tolist() for i in range(3)] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def stage_1_matches_reference(local_swarm, tmp_path, steps: int, name: str) -> None:
    local_swarm.stop_all()
    reference = reference_run(steps, microbatch_size=1)
    checkpoint = load_checkpoint(tmp_path / name, "gpt-tiny", 1, 3)
    assert_matches_reference(reference.stages[1], checkpoint.parameters, "stage 1", (4e-4, 3e-6))


@pytest.mark.timeout(300)
def test_a_mate_dying_before_its_slices_fails_the_round_alike_and_it_is_retried_without_it(local_swarm, tmp_path):
    """peer1a dies once the first round's contributors are agreed, before any slice of its gradient went
    out: no mate can sum its slice, every member gives the round up, and the retry without peer1a finds
    its samples lost; the trainer sends them again and stage 1 ends as one process would."""
    steps = 3
    start_swarm(
        local_swarm,
        tmp_path,
        {0: ["peer0"], 1: ["peer1a", "peer1b", "peer1c"], 2: ["peer2"]},
        {"peer1a": ["--faults", "before_slices@1=die", "--short-wait", "20"]},
    )
    flags = [*trainer_flags(steps, tmp_path / "summary.json", microbatch_size=1, in_flight=8)]
    trainer = local_swarm.start_trainer("trainer", [*flags, "--resend-buffer-mb", "64"])
    assert trainer_exit_code(local_swarm, trainer, 240) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    wait_for_records(local_swarm.initial_peers, lambda r: sum(p.step >= steps for p in r[1]) == 2)
    survivors = peer_infos(local_swarm, 1)
    assert len(survivors) == 2 and len({(i.step, i.fingerprint) for i in survivors}) == 1, survivors
    assert all(i.samples_lost == 0 and i.samples_doubled == 0 for i in survivors), survivors
    for name in ("peer1b", "peer1c"):
        # the round fails alike for all once its contributors were agreed; a survivor that had not yet taken
        # the dead mate's commit agrees without it instead: either way its samples are found lost and resent
        log = local_swarm.log_path(name).read_text()
        assert "the round failed" in log or "a mate died holding" in log, log[-3000:]
        assert not [entry for line in step_lines(tmp_path / f"{name}.ledger") for entry in line["lost"]]
    stage_1_matches_reference(local_swarm, tmp_path, steps, "peer1b")


@pytest.mark.timeout(300)
def test_a_sum_whose_owner_died_is_taken_from_a_mate_that_holds_it(local_swarm, tmp_path):
    """peer1a dies right after sending the sum of its slice to one mate: the other mate takes that sum
    from the first, the round completes for both with peer1a's samples in it, and nothing is retried."""
    steps = 3
    start_swarm(
        local_swarm,
        tmp_path,
        {0: ["peer0"], 1: ["peer1a", "peer1b", "peer1c"], 2: ["peer2"]},
        {"peer1a": ["--faults", "after_first_sum@1=die"]},
    )
    flags = [*trainer_flags(steps, tmp_path / "summary.json", microbatch_size=1, in_flight=8)]
    trainer = local_swarm.start_trainer("trainer", [*flags, "--resend-buffer-mb", "64"])
    assert trainer_exit_code(local_swarm, trainer, 240) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    wait_for_records(local_swarm.initial_peers, lambda r: sum(p.step >= steps for p in r[1]) == 2)
    survivors = peer_infos(local_swarm, 1)
    assert len({(i.step, i.fingerprint) for i in survivors}) == 1, survivors
    logs = [local_swarm.log_path(name).read_text() for name in ("peer1b", "peer1c")]
    assert sum("'s sum from" in log for log in logs) == 1, "one mate took the dead owner's sum from the other"
    assert not any("the round failed" in log for log in logs)
    ledgers = [step_lines(tmp_path / f"{name}.ledger") for name in ("peer1b", "peer1c")]
    first = [next(line for line in ledger if line["step"] == 0) for ledger in ledgers]
    assert first[0]["ids"] == first[1]["ids"] and not first[0]["lost"]  # both stepped on peer1a's samples too
    stage_1_matches_reference(local_swarm, tmp_path, steps, "peer1b")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "faults",
    [
        "after_contribution@1=delay:4,after_contribution@1=die",
        "before_slices@1=delay:4,before_slices@1=die",
        "before_slices@1=delay:4,before_slices@1=freeze:100,before_slices@1=die",
    ],
    ids=["after_contribution", "before_slices", "frozen_before_slices"],
)
def test_a_mate_dying_mid_round_is_dropped_within_seconds_not_at_the_averaging_timeout(local_swarm, tmp_path, faults):
    """peer1a dies 4 s into the first round, while its record outlives it by a minute here: after its offer
    (its mates wait for its commit) or after the commits (they wait for its slices). Either way they never
    come; the mates ask whether it lives, find it gone, and go on without it long before their 120 s
    averaging timeout; stage 1 ends as one process would. Frozen, its daemon takes the mates' questions and
    nothing answers them (a hung peer, or one killed without its daemon): two unanswered ones drop it."""
    steps = 3
    patient = ["--averaging-timeout", "120", "--record-ttl", "60", "--short-wait", "20"]
    # and the three stay on stage 1: a stage that looks empty (peer0 slow to renew its record and to answer a
    # probe on a loaded machine) is filled by a peer of the stage with the most to spare, pinned or not, unless
    # it keeps no standby copies; a mate that moved to stage 0 mid-round was never there to drop peer1a
    patient += ["--standby-stages", "0"]
    start_swarm(
        local_swarm,
        tmp_path,
        {0: ["peer0"], 1: ["peer1a", "peer1b", "peer1c"], 2: ["peer2"]},
        {"peer1a": ["--faults", faults, *patient], "peer1b": patient, "peer1c": patient},
    )
    flags = [*trainer_flags(steps, tmp_path / "summary.json", microbatch_size=1, in_flight=8)]
    trainer = local_swarm.start_trainer("trainer", [*flags, "--resend-buffer-mb", "64"])
    assert trainer_exit_code(local_swarm, trainer, 100) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    logs = {name: local_swarm.log_path(name).read_text() for name in ("peer1b", "peer1c")}
    # found gone by a question it left unanswered, or unreachable by one its dead daemon refused
    silent = [name for name, log in logs.items() if not DROPPED.search(log)]
    assert not silent, "\n".join(f"--- {name}\n{logs[name][-3000:]}" for name in silent)
    survivors = peer_infos(local_swarm, 1)
    assert len({(i.step, i.fingerprint) for i in survivors}) == 1, survivors
    stage_1_matches_reference(local_swarm, tmp_path, steps, "peer1b")


@pytest.mark.timeout(300)
def test_a_mate_whose_slices_cannot_reach_it_is_given_up_at_once_not_after_a_probe(local_swarm, tmp_path):
    """peer1a dies once the first round's contributors are agreed, before its slices go out; its record outlives
    it by a minute. Its mates' parts to it are refused at the dial, and they give the attempt up on that refusal
    rather than wait for a probe to find it gone (the probe first asks after seconds); the retry goes on without
    it and stage 1 ends as one process would. peer1a dies 3 s after the agreement, once its commit has surely
    reached peer1b (dead before, it is found gone in the commits); peer1b holds its parts back 6 s, so that they
    leave once peer1a is surely gone (sent a moment before its death, they would be taken and only a probe could
    tell)."""
    steps = 3
    patient = ["--averaging-timeout", "120", "--record-ttl", "60", "--short-wait", "20", "--standby-stages", "0"]
    start_swarm(
        local_swarm,
        tmp_path,
        {0: ["peer0"], 1: ["peer1a", "peer1b"], 2: ["peer2"]},
        {
            "peer1a": ["--faults", "before_slices@1=delay:3,before_slices@1=die", *patient],
            "peer1b": ["--faults", "before_slices@1=delay:6", *patient],
        },
    )
    flags = [*trainer_flags(steps, tmp_path / "summary.json", microbatch_size=1, in_flight=8)]
    trainer = local_swarm.start_trainer("trainer", [*flags, "--resend-buffer-mb", "64"])
    assert trainer_exit_code(local_swarm, trainer, 100) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    log = local_swarm.log_path("peer1b").read_text()
    assert "step 0: this peer's slices could not reach" in log, log[-3000:]
    assert "the round failed" in log or "a mate died holding" in log, log[-3000:]
    stage_1_matches_reference(local_swarm, tmp_path, steps, "peer1b")
