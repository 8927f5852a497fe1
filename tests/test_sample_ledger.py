"""The sample ledger's analysis: reading ledger files back and accounting for samples by id, per stage."""

from __future__ import annotations

import json

import pytest

from swarm.sample_ledger import SampleLedger, account, fed_record, read_ledger, step_record


def fed(*ids: tuple[str, int, int]) -> list[dict]:
    return [fed_record(trainer, mb, samples) for trainer, mb, samples in ids]


def step(peer: str, stage: int, number: int, ids, lost=(), fingerprint: str = "f") -> dict:
    return step_record(peer, stage, number, list(ids), list(lost), fingerprint)


A1, A2, A3, B1 = ("a", 1, 8), ("a", 2, 8), ("a", 3, 8), ("b", 1, 4)


def test_exact_run_counts_nothing_wrong():
    report = account(fed(A1, A2, B1), [step("p", 0, 0, [A1, B1]), step("p", 0, 1, [A2])])
    counts = report["stages"][0]
    assert counts["samples_fed"] == counts["samples_stepped"] == 20
    assert counts["steps"] == 2
    for name in ("samples_lost", "samples_doubled", "samples_orphaned", "samples_declared_lost"):
        assert counts[name] == 0, name
    assert counts["divergent_steps"] == []
    assert report["totals"] == {
        "samples_fed": 20,
        "samples_lost": 0,
        "samples_silently_lost": 0,
        "samples_doubled": 0,
        "samples_orphaned": 0,
        "divergent_steps": 0,
    }


def test_lost_ids_are_those_a_stage_never_summed():
    # stage 1 declared A2 lost; stage 0 dropped A3 without a word
    steps = [step("p0", 0, 0, [A1, A2]), step("p1", 1, 0, [A1, A3], lost=[A2])]
    report = account(fed(A1, A2, A3), steps)
    stage0, stage1 = report["stages"][0], report["stages"][1]
    assert (stage0["samples_lost"], stage0["lost_ids"]) == (8, [["a", 3]])
    assert stage0["samples_silently_lost"] == 8 and stage0["samples_declared_lost"] == 0
    assert (stage1["samples_lost"], stage1["lost_ids"]) == (8, [["a", 2]])
    assert stage1["samples_declared_lost"] == 8 and stage1["samples_silently_lost"] == 0
    assert report["totals"]["samples_lost"] == 16
    assert report["totals"]["samples_silently_lost"] == 8


def test_a_declared_loss_later_resent_is_not_lost():
    steps = [step("p", 0, 0, [A1], lost=[A2]), step("p", 0, 1, [A2])]
    counts = account(fed(A1, A2), steps)["stages"][0]
    assert counts["samples_lost"] == 0 and counts["samples_declared_lost"] == 8


def test_doubles_count_every_extra_sum_across_steps_and_within_one():
    steps = [step("p", 0, 0, [A1, A1, B1]), step("p", 0, 1, [A1, B1, A2])]
    counts = account(fed(A1, A2, B1), steps)["stages"][0]
    assert counts["samples_doubled"] == 2 * 8 + 4  # A1 twice over, B1 once
    assert counts["doubled_ids"] == [["a", 1], ["b", 1]]
    assert counts["samples_stepped"] == counts["samples_fed"] + counts["samples_doubled"]


def test_orphans_are_summed_ids_no_trainer_reported_fed():
    # trainer b was killed after stage 0's backward but before it wrote its fed line
    counts = account(fed(A1), [step("p", 0, 0, [A1, B1, B1])])["stages"][0]
    assert counts["samples_orphaned"] == 8  # both sums of B1, sized from the step line
    assert counts["orphan_ids"] == [["b", 1]]
    assert counts["samples_lost"] == 0


def test_replicas_vote_and_disagreements_are_divergent_steps():
    steps = [
        step("p1", 0, 0, [A1, A2], fingerprint="good"),
        step("p2", 0, 0, [A1, A2], fingerprint="good"),
        step("p3", 0, 0, [A1], fingerprint="bad"),  # outvoted: its missing A2 is not a loss
        step("p1", 0, 1, [A3], fingerprint="x"),
        step("p2", 0, 1, [A3], fingerprint="x"),
    ]
    counts = account(fed(A1, A2, A3), steps)["stages"][0]
    assert counts["divergent_steps"] == [0]
    assert counts["samples_lost"] == 0 and counts["samples_stepped"] == 24
    assert counts["steps"] == 2


def test_a_tie_goes_to_the_smallest_peer_id():
    steps = [step("p2", 0, 0, [A1, A2], fingerprint="y"), step("p1", 0, 0, [A1], fingerprint="x")]
    counts = account(fed(A1, A2), steps)["stages"][0]
    assert counts["lost_ids"] == [["a", 2]]  # p1's line stands for the step
    assert counts["divergent_steps"] == [0]
    reversed_order = account(fed(A1, A2), steps[::-1])["stages"][0]
    assert reversed_order == counts


def test_a_peers_repeated_line_for_a_step_counts_once():
    steps = [step("p", 0, 0, [A1]), step("p", 0, 0, [A1])]
    counts = account(fed(A1), steps)["stages"][0]
    assert counts["samples_doubled"] == 0 and counts["divergent_steps"] == []


def test_a_fed_id_counts_once_and_other_kinds_are_ignored():
    everything = [*fed(A1, A1), step("p", 0, 0, [A1]), {"kind": "note"}]
    report = account(everything, everything)
    assert report["totals"]["samples_fed"] == 8
    assert report["stages"][0]["samples_stepped"] == 8


def test_read_ledger_skips_a_torn_last_line(tmp_path):
    trainer, peer = tmp_path / "trainer.jsonl", tmp_path / "peer.jsonl"
    SampleLedger(trainer).write(fed_record("a", 1, 8))
    SampleLedger(peer).write(step_record("p", 0, 0, [A1], [], "f"))
    with open(peer, "a") as file:
        file.write(json.dumps(step_record("p", 0, 1, [A2], [], "g"))[:20])  # killed mid-write
    records = read_ledger([trainer, peer])
    assert [r["kind"] for r in records] == ["fed", "step"]
    assert read_ledger(trainer) == [fed_record("a", 1, 8)]


def test_read_ledger_keeps_a_whole_last_line_without_newline(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text(json.dumps(fed_record("a", 1, 8)) + "\n" + json.dumps(fed_record("a", 2, 8)))
    assert [r["mb"] for r in read_ledger(path)] == [1, 2]


def test_read_ledger_refuses_a_bad_line_before_the_end(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"kind": "fed", "trai\n' + json.dumps(fed_record("a", 1, 8)) + "\n")
    with pytest.raises(ValueError, match="l.jsonl:1"):
        read_ledger(path)


def test_no_ledger_writes_nothing(tmp_path):
    SampleLedger(None).write(fed_record("a", 1, 8))
    assert list(tmp_path.iterdir()) == []
