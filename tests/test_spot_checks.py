"""Spot checks: a vouched trainer compares a share of forwards across peers of a stage, and accuses a liar."""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import peer_flags, trainer_flags, wait_for_records

from swarm.compression import get_codec
from swarm.records.accusations import Accusation, AccusationBook, parse_records, sign_accusation
from swarm.records.stage_records import SERVING
from swarm.trainer.spot_checks import odd_one_out, outputs_agree, tolerance
from swarm.trust.receipts import ReceiptSigner
from swarm.trust.vouchers import TrustRoot, load_root_key, load_voucher, make_root_key, make_voucher

HOSTILE = Path(__file__).parents[1] / "scripts" / "harness" / "hostile_peer.py"
TRAINER = "QmTrainerTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT"
LIAR = "QmPeerLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLL"
WITNESS = "QmPeerWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWW"
OTHER = "QmPeerXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
ACCUSED_LINE = re.compile(r"peer (\S+) of stage (\d+) is accused by trainer \S+ .*at step (\d+)")


@pytest.fixture
def organizer(tmp_path):
    """A trust root and one voucher: (the root's public text, the voucher file)."""
    public = make_root_key(tmp_path / "root.key")
    make_voucher(load_root_key(tmp_path / "root.key"), "lab-trainer", tmp_path / "trainer.voucher")
    return public, tmp_path / "trainer.voucher"


def test_outputs_agree_within_the_nondeterminism_of_a_forward_not_beyond():
    torch.manual_seed(0)
    hidden = torch.randn(4, 16, 32) * 3
    assert outputs_agree([hidden], [hidden.clone()])
    assert outputs_agree([hidden], [hidden + 1e-6 * torch.randn_like(hidden)])  # another batching on a CPU
    assert not outputs_agree([hidden], [hidden + 0.1 * torch.randn_like(hidden)])  # the hostile peer's noise
    assert not outputs_agree([hidden], [hidden[:2]]) and not outputs_agree([hidden], [hidden.double()])
    half = hidden.to(torch.bfloat16)
    assert tolerance(half) > tolerance(hidden)
    assert outputs_agree([half], [(hidden * (1 + 2**-8)).to(torch.bfloat16)])  # a unit in bfloat16's last place
    # both replies in 8bit: a hair apart before encoding may be a level apart after, never more
    codec = get_codec("8bit")
    a, b = (codec.decode(codec.encode(t), t.shape, t.dtype) for t in (hidden, hidden + 1e-6 * torch.randn_like(hidden)))
    assert outputs_agree([a], [b], "8bit")
    noisy = hidden + 0.1 * torch.randn_like(hidden)
    assert not outputs_agree([a], [codec.decode(codec.encode(noisy), noisy.shape, noisy.dtype)], "8bit")


def test_gradients_are_compared_relative_to_their_own_scale():
    torch.manual_seed(0)
    grad = torch.randn(4, 16, 32) * 1e-6  # input gradients of a mean loss: far below the outputs' absolute floor
    lie = grad + 0.1 * float(grad.abs().max()) * torch.randn_like(grad)
    assert outputs_agree([grad], [lie]), "with the forwards' absolute floor a lie at this scale would pass"
    assert not outputs_agree([grad], [lie], floor=0.0)
    assert outputs_agree([grad], [grad * (1 + 1e-6 * torch.randn_like(grad))], floor=0.0)  # another batching
    assert outputs_agree([torch.zeros(2, 3)], [torch.zeros(2, 3)], floor=0.0)


def test_the_odd_one_out_needs_two_agreeing_answers():
    a = [torch.ones(2, 3)]
    wrong = [torch.ones(2, 3) + 0.5]
    assert odd_one_out({"A": a, "B": wrong, "C": [a[0].clone()]}) == ("B", ["A", "C"])
    assert odd_one_out({"A": wrong, "B": a, "C": a}) == ("A", ["B", "C"])
    assert odd_one_out({"A": a, "B": wrong}) is None  # two peers: no one can tell which lied
    assert odd_one_out({"A": a, "B": wrong, "C": [a[0] - 0.5]}) is None  # no two agree
    assert odd_one_out({"A": a, "B": a, "C": a}) is None


def accusation(organizer, **changes) -> Accusation:
    public, voucher_file = organizer
    voucher, key = load_voucher(voucher_file)
    fields = dict(stage=1, accused=LIAR, step=3, microbatch=77, accused_digest="aa" * 8, witness_digest="bb" * 8)
    return sign_accusation(
        ReceiptSigner("run", key, voucher), TRAINER, **{**fields, "witnesses": (WITNESS,), **changes}
    )


def test_an_accusation_holds_only_as_signed_by_a_vouched_trainer(organizer, tmp_path, caplog):
    public, _ = organizer
    root = TrustRoot.from_text(public)
    signed = accusation(organizer)
    assert signed.problem(root, "run") is None
    parsed = Accusation.from_value(json.loads(json.dumps(signed.to_value())))
    assert parsed == signed and parsed.problem(root, "run") is None
    for field, value in [("accused", OTHER), ("step", 4), ("microbatch", 1), ("accused_digest", "cc" * 8)]:
        forged = Accusation.from_value({**signed.to_value(), field: value})
        assert forged is not None and "does not hold" in forged.problem(root, "run"), field
    assert "another run" in signed.problem(root, "other-run")
    other_root = TrustRoot.from_text(make_root_key(tmp_path / "other.key"))
    assert "did not vouch" in signed.problem(other_root, "run")
    # malformed values cost no signature check: refused whole
    for broken in [{**signed.to_value(), "step": -1}, {**signed.to_value(), "witnesses": []}, {"x": 1}, None]:
        assert Accusation.from_value(broken) is None
    assert Accusation.from_value({**signed.to_value(), "accused": "not a peer id"}) is None
    book = AccusationBook(root, "run", "Stage 1 peer")
    with caplog.at_level(logging.WARNING):
        assert book.take([signed, signed, accusation(organizer, microbatch=78)]) == [LIAR]
    assert sum("is accused by trainer" in r.message for r in caplog.records) == 1  # named once
    assert book.take([Accusation.from_value({**signed.to_value(), "accused": WITNESS})]) == []
    assert book.refused == 1 and list(book.accused) == [LIAR]


def test_a_record_carries_only_its_own_signer_s_accusations(organizer):
    signed = accusation(organizer)
    item = SimpleNamespace(value={"accusations": [signed.to_value()]})
    # the subkey of a signed record is its owner's key: one that hashes to another peer id is not the trainer's
    assert parse_records([(b"[owner:not-the-trainer]", item)]) == []
    assert parse_records([(b"x", SimpleNamespace(value={"accusations": [signed.to_value()] * 33}))]) == []


def start_swarm(
    local_swarm,
    tmp_path,
    public: str,
    stage1: list[str],
    hostile: str | None = None,
    faults: str = "",
    attack: str = "wrong-outputs",
) -> None:
    """Stages 0 and 2 with one peer each, stage 1 with `stage1` (`hostile` runs `attack`, peer1a is started
    with `faults`)."""
    local_swarm.start_bootstrap()
    for stage, names in {0: ["peer0"], 1: stage1, 2: ["peer2"]}.items():
        for name in names:
            flags = peer_flags(tmp_path / name, "--trust-root", public)
            if name == hostile:
                prefix = [sys.executable, str(HOSTILE), attack, "--"]
                pinned = ["--stage", "1", "--initial-peers", *local_swarm.initial_peers, "--rebalance-period", "0"]
                local_swarm.spawn(name, "peer", [*pinned, *flags], prefix=prefix)
            else:
                injected = ["--faults", faults] if name == "peer1a" and faults else []
                local_swarm.start_peer(name, stage, [*flags, *injected])
    serving = [lambda r, s=s: sum(p.state == SERVING for p in r[s]) for s in range(3)]
    wait_for_records(local_swarm.initial_peers, lambda r: [count(r) for count in serving] == [1, len(stage1), 1])


def start_trainer(local_swarm, tmp_path, organizer, steps: int, share: float, *extra: str):
    public, voucher_file = organizer
    flags = [
        *trainer_flags(steps, tmp_path / "summary.json", 4),
        "--trust-root",
        public,
        "--voucher",
        str(voucher_file),
    ]
    return local_swarm.start_trainer("trainer", [*flags, "--spot-check-share", str(share), *extra])


def finish(local_swarm, tmp_path, trainer) -> dict:
    assert trainer.wait(400) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    return json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attack", ["wrong-outputs", "wrong-backwards"])
def test_a_peer_answering_wrong_forwards_or_backwards_is_accused_and_left_out(local_swarm, tmp_path, organizer, attack):
    """peer1b adds noise to every forward it answers, or to the input gradients of every backward. With a
    quarter of calls checked, the trainer finds two peers of stage 1 agreeing against it (a backward is asked
    again as a check, which holds nothing), accuses it, and calls it no more; its honest mates read the
    accusation and leave it out of their rounds, within 10 steps of the start."""
    public, _ = organizer
    start_swarm(local_swarm, tmp_path, public, ["peer1a", "peer1b", "peer1c"], hostile="peer1b", attack=attack)
    steps = 12
    summary = finish(local_swarm, tmp_path, start_trainer(local_swarm, tmp_path, organizer, steps, share=0.25))
    assert summary["steps"] == steps and summary["spot_checks"]["accusations"] >= 1, summary["spot_checks"]
    liar = peer_id(local_swarm, "peer1b")
    for name in ("trainer", "peer1a", "peer1c"):
        found = ACCUSED_LINE.search(local_swarm.log_path(name).read_text())
        assert found, f"{name} did not take the accusation in"
        assert found.groups() == (liar, "1", found.group(3)) and int(found.group(3)) <= 10, found.group(0)
    print(f"spot checks {summary['spot_checks']}; accused at step {found.group(3)}")
    accused_by_trainer = {m.group(1) for m in ACCUSED_LINE.finditer(local_swarm.log_path("trainer").read_text())}
    assert accused_by_trainer == {liar}


def peer_id(local_swarm, name: str) -> str:
    return re.search(r"; peer id (\S+)\.", local_swarm.log_path(name).read_text()).group(1)


@pytest.mark.timeout(600)
def test_honest_peers_are_never_accused_under_churn(local_swarm, tmp_path, organizer):
    """Three honest peers on stage 1; one is SIGKILLed (with its daemons) right after the stage's third step, with
    calls of the next one under way; half of all forwards are checked: answers are compared across peers at the
    same step, and no one is accused."""
    public, _ = organizer
    # every member steps with its stage, whatever work routing gave it: a peer measured slow on a loaded machine
    # got fewer than 2 backwards in 14 steps, so a fault at its Nth backward never struck
    start_swarm(local_swarm, tmp_path, public, ["peer1a", "peer1b", "peer1c"], faults="after_step@3=die")
    trainer = start_trainer(local_swarm, tmp_path, organizer, 14, 0.5, "--emulate-latency-ms", "20")
    summary = finish(local_swarm, tmp_path, trainer)
    counts = summary["spot_checks"]
    print(f"spot checks {counts}")
    assert summary["steps"] == 14 and counts["compared"] >= 10, counts
    assert counts["mismatches"] == 0 and counts["accusations"] == 0, counts
    assert local_swarm.processes["peer1a"].poll() == -signal.SIGKILL, "peer1a never reached the stage's third step"
    for log in local_swarm.workdir.glob("*.log"):
        assert "is accused by trainer" not in log.read_text(errors="replace"), log.name
