"""The sample ledger's analysis: reading ledger files back and accounting for samples by id, per stage."""

from __future__ import annotations

import json

import pytest

from swarm.records.sample_ledger import (
    SampleLedger,
    account,
    fed_record,
    left_record,
    read_ledger,
    restore_record,
    step_record,
)


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


# --- a stage whose every peer died, brought back from a standby copy of an older step ---------------------
#
# A step line is numbered by the state it started from: the dead peers, which had reached step 7 (seven
# steps applied), wrote lines 0..6; a copy "at step 5" holds lines 0..4, so lines 5 and 6 are the
# abandoned history and the restorer's next lines are 5, 6 and 7.

K = [("a", n, 8) for n in range(5)]  # summed by lines 0..4, which the copy holds
R5, R6 = ("a", 10, 8), ("a", 11, 8)  # summed only by the abandoned lines 5 and 6
AGAIN = ("a", 12, 4)  # summed by abandoned line 5 and again by the new history
HELD = ("b", 1, 8)  # fed after the dead peers' last step: in their unfinished step 7 when they died
EARLY = ("b", 2, 2)  # fed long before the death and dropped without a word: still silent
M5, M6, M7 = ("c", 5, 8), ("c", 6, 8), ("c", 7, 8)  # summed by the new history


def at(record: dict, moment: float) -> dict:
    return {**record, "time": moment}


def timed_fed(*entries: tuple[tuple[str, int, int], float]) -> list[dict]:
    return [fed_record(trainer, mb, samples, at=moment) for (trainer, mb, samples), moment in entries]


def died_and_restored(restore: bool = True) -> list[dict]:
    """Stage 1's peers d1, d2 step 0..6 at times 10..16, die; r restores it at step 5 at 20 and steps 5..7."""
    feds = timed_fed(
        *((k, 9.5 + n) for n, k in enumerate(K)),
        (R5, 14.5),
        (AGAIN, 14.6),
        (R6, 15.5),
        (HELD, 16.5),
        (EARLY, 3.5),
        (M5, 20.5),
        (M6, 21.5),
        (M7, 22.5),
    )
    old = {n: [K[n]] for n in range(5)} | {5: [R5, AGAIN], 6: [R6]}
    lines = [
        at(step(peer, 1, n, ids, fingerprint=f"old{n}"), 10.0 + n) for n, ids in old.items() for peer in ("d1", "d2")
    ]
    if restore:
        lines.append(at(restore_record("r", 1, 5, 7), 20.0))
    new = {5: [AGAIN, M5], 6: [M6], 7: [M7]}
    lines += [at(step("r", 1, n, ids, fingerprint=f"new{n}"), 16.0 + n) for n, ids in new.items()]
    # stage 0 lived on and summed everything: the restore of stage 1 is no concern of its
    everything = [*K, R5, AGAIN, R6, HELD, EARLY, M5, M6, M7]
    lines.append(at(step("p0", 0, 0, everything), 23.0))
    return feds + lines


def test_a_restore_names_the_rolled_back_and_the_held_ids_and_leaves_no_divergence():
    report = account(*[died_and_restored()] * 2)
    counts = report["stages"][1]
    assert counts["divergent_steps"] == []  # the abandoned lines 5, 6 do not vote against the new ones
    assert counts["steps"] == 8 and counts["steps_rolled_back"] == 2 and counts["restores"] == 1
    assert counts["rolled_back_ids"] == [["a", 10], ["a", 11]] and counts["samples_rolled_back"] == 16
    assert counts["lost_with_stage_ids"] == [["b", 1]] and counts["samples_lost_with_stage"] == 8
    assert counts["lost_ids"] == [["a", 10], ["a", 11], ["b", 1], ["b", 2]] and counts["samples_lost"] == 26
    assert counts["samples_silently_lost"] == 2  # EARLY only
    assert counts["samples_doubled"] == 0  # AGAIN counts once: the abandoned sum of it was undone
    assert counts["samples_stepped"] == 5 * 8 + 4 + 3 * 8
    assert report["stages"][0]["restores"] == 0 and report["stages"][0]["samples_lost"] == 0
    assert report["totals"] == {
        "samples_fed": 5 * 8 + 8 + 4 + 8 + 8 + 2 + 3 * 8,
        "samples_lost": 26,
        "samples_silently_lost": 2,
        "samples_doubled": 0,
        "samples_orphaned": 0,
        "restores": 1,
        "steps_rolled_back": 2,
        "samples_rolled_back": 16,
        "samples_lost_with_stage": 8,
        "divergent_steps": 0,
    }


def test_an_id_fed_just_before_the_last_line_and_served_after_it_is_lost_with_the_stage_not_silently():
    # fed at 15.8, after the dead peers reached step 6 (line 5 at 15) and before their line 6 (at 16): its
    # forward ran at step 6 and its backward, one step stale, at step 7, which died unfinished
    crossed = ("b", 3, 8)
    records = [*died_and_restored(), *timed_fed((crossed, 15.8))]
    counts = account(records, records)["stages"][1]
    assert counts["lost_with_stage_ids"] == [["b", 1], ["b", 3]] and counts["samples_lost_with_stage"] == 16
    assert counts["samples_silently_lost"] == 2  # EARLY only, as before


def test_a_peer_that_joined_at_the_step_before_the_last_does_not_move_the_stages_arrival_later():
    """Traced in a wave run: a peer took the stage's state at step 105 and wrote its line for 105 two seconds after
    the others; a backward served in between, held toward step 107, died with the stage. Timed by the joiner's
    line, the stage reached 106 after that backward, and the loss was filed as silent."""
    served = ("b", 5, 8)
    joiner = [
        at(step("j", 1, 5, [R5, AGAIN], fingerprint="old5"), 15.9),
        at(step("j", 1, 6, [R6], fingerprint="old6"), 16.0),
    ]
    records = [*died_and_restored(), *joiner, *timed_fed((served, 15.2))]
    counts = account(records, records)["stages"][1]
    assert counts["lost_with_stage_ids"] == [["b", 1], ["b", 5]] and counts["samples_silently_lost"] == 2
    assert counts["divergent_steps"] == []


def test_an_id_the_dead_stage_served_is_lost_with_it_though_the_stages_below_served_it_after_the_restore():
    """Traced in a wave run: stages 1 and 2 died together; stage 2's peers had served the microbatch's backward,
    and stage 1 served it only once restored, after stage 2's restore. By stage 0's time it was fed after the
    restore: a silent loss, though stage 2 held it when it died."""
    served_late = ("b", 4, 8)
    late = fed_record(*served_late, at=24.0, stage_times=[24.0, 16.5, 16.4])
    records = [*died_and_restored(), late]
    counts = account(records, records)["stages"][1]
    assert counts["lost_with_stage_ids"] == [["b", 1], ["b", 4]] and counts["samples_silently_lost"] == 2
    # by stage 0's time alone (a ledger of an older trainer) it is silent, as before
    records = [*died_and_restored(), fed_record(*served_late, at=24.0)]
    assert account(records, records)["stages"][1]["samples_silently_lost"] == 2 + 8


def test_without_its_restore_line_the_same_history_is_divergent_and_silent():
    counts = account(*[died_and_restored(restore=False)] * 2)["stages"][1]
    assert counts["divergent_steps"] == [5, 6]
    assert counts["samples_rolled_back"] == counts["samples_lost_with_stage"] == counts["steps_rolled_back"] == 0
    assert counts["samples_silently_lost"] == counts["samples_lost"]


def test_a_stage_restored_twice_abandons_each_history_past_each_copy():
    # after the restore at 20, r steps 5..8 (times 21..24) and dies; q restores step 7 at 30 and steps 7, 8
    lines = [at(step("d", 1, n, [], fingerprint=f"old{n}"), 10.0 + n) for n in range(7)]
    lines.append(at(restore_record("r", 1, 5, 7), 20.0))
    lines += [at(step("r", 1, n, [("r", n, 1)], fingerprint=f"r{n}"), 16.0 + n) for n in range(5, 9)]
    lines.append(at(restore_record("q", 1, 7, 9), 30.0))
    lines += [at(step("q", 1, n, [], fingerprint=f"q{n}"), 24.0 + n) for n in (7, 8)]
    feds = timed_fed(*((("r", n, 1), 20.0 + n) for n in range(5, 9)))
    counts = account(feds, lines)["stages"][1]
    assert counts["restores"] == 2 and counts["steps_rolled_back"] == 4 and counts["steps"] == 9
    assert counts["divergent_steps"] == []
    assert counts["rolled_back_ids"] == [["r", 7], ["r", 8]]  # r's lines 5, 6 stand: q's copy holds them
    assert counts["samples_silently_lost"] == 0


def test_a_fed_line_without_a_time_is_never_lost_with_the_stage():
    records = [r for r in died_and_restored() if (r.get("trainer"), r.get("mb")) != HELD[:2]]
    records.append(fed_record(*HELD))
    counts = account(records, records)["stages"][1]
    assert counts["samples_lost_with_stage"] == 0 and counts["samples_silently_lost"] == 2 + 8


def test_with_no_restore_line_the_new_counts_are_empty_and_the_totals_unchanged():
    steps = [step("p", 0, 0, [A1]), step("p", 0, 1, [A2])]
    report = account(timed_fed((A1, 1.0), (A2, 2.0), (A3, 3.0)), steps)
    counts = report["stages"][0]
    assert counts["restores"] == counts["steps_rolled_back"] == 0
    assert counts["samples_rolled_back"] == counts["samples_lost_with_stage"] == 0
    assert counts["rolled_back_ids"] == counts["lost_with_stage_ids"] == []
    assert counts["samples_silently_lost"] == 8
    assert set(report["totals"]) == {
        "samples_fed",
        "samples_lost",
        "samples_silently_lost",
        "samples_doubled",
        "samples_orphaned",
        "divergent_steps",
    }


def test_ids_a_peer_left_holding_and_no_step_summed_are_lost_with_the_leave_not_silently():
    # the last peers of stage 0 stopped holding A3 of their unfinished step; stage 1 had summed it
    steps = [step("p", 0, 0, [A1, A2]), step("q", 1, 0, [A1, A2, A3])]
    silent = account(fed(A1, A2, A3), steps)
    assert silent["stages"][0]["samples_silently_lost"] == 8 and "samples_lost_with_leave" not in silent["totals"]
    left = [left_record("p", 0, 1, [A3], handed_to=0)]
    report = account(fed(A1, A2, A3), [*steps, *left])
    counts = report["stages"][0]
    assert counts["samples_lost"] == counts["samples_lost_with_leave"] == 8
    assert counts["lost_with_leave_ids"] == [["a", 3]] and counts["samples_silently_lost"] == 0
    assert report["totals"]["samples_lost_with_leave"] == 8 and report["stages"][1]["samples_lost_with_leave"] == 0
    # handed to a mate that summed it later: nothing lost at all
    handed = account(fed(A1, A2, A3), [*steps, *left, step("r", 0, 1, [A3])])
    assert handed["stages"][0]["samples_lost"] == handed["stages"][0]["samples_lost_with_leave"] == 0


def test_the_records_say_when():
    assert fed_record("a", 1, 8, at=12.34567)["time"] == 12.346
    record = restore_record("r", 1, 5, 7)
    assert {k: record[k] for k in ("kind", "peer", "stage", "step", "reached")} == {
        "kind": "restore",
        "peer": "r",
        "stage": 1,
        "step": 5,
        "reached": 7,
    }
    assert isinstance(record["time"], float)
