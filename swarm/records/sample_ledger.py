"""A ledger of samples by identity: which microbatches a trainer fed and which ones each stage stepped on.

A microbatch is named globally by (trainer id, microbatch id). With `--ledger FILE`, a trainer
appends one JSON line per microbatch whose backward reached stage 0 (`fed`), and a peer appends
one JSON line per step it applies: the ids summed into that step, those it gave up as lost, and
the fingerprint of the parameters after the step. A peer that brings back a stage whose every peer
died, from a standby copy of an older step, appends a `restore` line; one that leaves its stage holding
samples it has not stepped on appends a `left` line naming them. Tools such as
`scripts/chaos.py` read the lines back to count, by id and per stage, what was lost or counted
twice, and which replicas differ.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SampleId = tuple[str, int]  # (trainer id, microbatch id)


class SampleLedger:
    """Appends JSON lines to a file, one `write` a line; safe to call from several threads."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if not self.path:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock, open(self.path, "a") as file:
            file.write(line)


def fed_record(
    trainer: str, microbatch: int, samples: int, at: float | None = None, stage_times: list[float] | None = None
) -> dict[str, Any]:
    """A trainer's line: this microbatch went through every stage, forward and backward.

    `at` (wall clock, `time.time()`) says when its backward reached stage 0, and `stage_times` when each stage
    (stage 0 first) served it, to place it before or after a stage's restore: a later stage can serve a
    backward long before the stages below it do (they may be dead and restored meanwhile). The line has no
    `time` when `at` is None, and a stage without its own time is placed by `time`.
    """
    record: dict[str, Any] = {"kind": "fed", "trainer": trainer, "mb": microbatch, "samples": samples}
    if at is not None:
        record["time"] = round(at, 3)
    if stage_times is not None:
        record["stage_times"] = [round(t, 3) for t in stage_times]
    return record


def step_record(
    peer: str,
    stage: int,
    step: int,
    ids: list[tuple[str, int, int]],
    lost: list[tuple[str, int, int]],
    fingerprint: str,
    round_seconds: float = 0.0,
) -> dict[str, Any]:
    """A peer's line: at `step` its stage summed `ids` ((trainer, microbatch, samples), a repeat counted twice)
    and gave up `lost`; `fingerprint` names the parameters after the step. `time` (wall clock) says when,
    and `round_seconds` how long the stage's work waited on the averaging round that agreed on it."""
    return {
        "kind": "step",
        "peer": peer,
        "stage": stage,
        "step": step,
        "ids": [list(i) for i in ids],
        "lost": [list(i) for i in lost],
        "fingerprint": fingerprint,
        "time": round(time.time(), 3),
        "round_seconds": round(round_seconds, 4),
    }


def restore_record(peer: str, stage: int, step: int, reached: int) -> dict[str, Any]:
    """A peer's line: it brought `stage`, whose every peer had died, back from a standby copy of its state
    after `step` steps, when the stage had reached step `reached` as this peer saw it (`reached - step`
    steps of progress lost). `time` (wall clock) says when: the stage's step lines numbered `step` or
    more written before it belong to the history the restore abandoned."""
    return {
        "kind": "restore",
        "peer": peer,
        "stage": stage,
        "step": step,
        "reached": reached,
        "time": round(time.time(), 3),
    }


# ---------------------------------------------------------------------------------------------
# Reading the ledger back and accounting for every sample, by id and per stage.

SampleKey = tuple[str, int]  # (trainer, microbatch): the identity of a microbatch, without its size


def left_record(peer: str, stage: int, step: int, ids: list[tuple[str, int, int]], handed_to: int) -> dict[str, Any]:
    """A peer's line: it left `stage` at `step` holding `ids` it had not stepped on, and `handed_to` mates took
    them (0: none could, and they are given up). An id no later step sums was lost with the leave, said so."""
    return {
        "kind": "left",
        "peer": peer,
        "stage": stage,
        "step": step,
        "ids": [list(i) for i in ids],
        "handed_to": handed_to,
        "time": round(time.time(), 3),
    }


def read_ledger(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Every record in the ledger files `paths`, in file order.

    A process killed while writing leaves a torn last line (no newline, cut JSON): it is skipped.
    A line that does not parse anywhere else is corruption, not a kill, and raises ValueError.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    records = []
    for path in paths:
        with open(path, errors="replace") as file:
            lines = file.read().split("\n")
        # after the final newline split leaves "" (a complete file) or the torn tail of a killed writer
        *whole, tail = lines
        for number, line in enumerate(whole, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a ledger record ({e})") from None
        if tail.strip():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(tail))  # complete but for its newline: keep it
    return records


def _key(entry: list | tuple) -> SampleKey:
    return (str(entry[0]), int(entry[1]))


def _chosen_line(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the replicas' lines for one (stage, step): one with the fingerprint most replicas wrote.

    Ties go to the fingerprint written by the smallest peer id, and of its lines the smallest
    peer's is taken, so the choice depends only on the lines, not on their order.
    """
    by_fingerprint: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        by_fingerprint[line["fingerprint"]].append(line)
    best = min(by_fingerprint.values(), key=lambda group: (-len(group), min(str(g["peer"]) for g in group)))
    return min(best, key=lambda line: str(line["peer"]))


def _samples(counts: dict[SampleKey, int], sizes: dict[SampleKey, int]) -> int:
    return sum(counts[key] * sizes[key] for key in counts)


def _ids(keys: Iterable[SampleKey]) -> list[list]:
    return [list(key) for key in sorted(keys)]


def _epoch(line: dict[str, Any], restore_times: list[float]) -> int:
    """How many of its stage's restores (their times, sorted) came before this line was written."""
    written = line.get("time")
    return len(restore_times) if written is None else bisect.bisect_right(restore_times, float(written))


def _abandoned(line: dict[str, Any], restores: list[dict[str, Any]]) -> bool:
    """Whether a later restore of its stage took the stage back to a step at or before this line's step."""
    written = line.get("time")
    return written is not None and any(
        float(written) < float(r["time"]) and int(r["step"]) <= int(line["step"]) for r in restores
    )


def _written_before(line: dict[str, Any], stage: int, moment: float) -> bool:
    """Whether this step line is of `stage` and was written before `moment`."""
    return int(line["stage"]) == stage and line.get("time") is not None and float(line["time"]) < moment


def account(fed_lines: Iterable[dict[str, Any]], step_lines: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Accounts, per stage and by microbatch id, for the samples trainers fed and stages stepped on.

    For each (stage, step) one replica's line stands for the stage (see `_chosen_line`); the
    others only vote on divergence. A peer's repeated line for the same (stage, step) counts once
    (its last). Records of another kind in either input are ignored, so both may be the whole ledger.

    A `restore` line (in `step_lines`) says a stage whose every peer died came back from a standby copy
    after S steps (its `step`). The stage's step lines numbered S or more and written before the restore
    (a line is numbered by the state it started from, so line S is the first the copy lacks) belong to
    an abandoned history: they are not counted as stepped and do not vote against the new history's
    lines for the same step; they vote only among themselves (the replicas of one history, between two
    restores). Fed ids of theirs that the new history never sums are rolled back. Fed ids that the stage
    never summed, in any history, fed before that restore but after the stage reached the step of the
    last line it wrote, are lost with the stage: it was working on them when it died. A microbatch is
    summed into the step the stage was at when it served its backward, which may be one step past its
    forward's (`--max-staleness`, 1 by default): one fed just before the last line can still be served
    after it, while one fed before the stage reached that line's step was summed by it at the latest.
    Both kinds are declared losses, not silent ones. A fed line is placed by when the stage itself served
    its backward (`stage_times`), else by when stage 0 did (`time`): stages below a dead one serve it later.
    Fed lines without a `time` are never placed before a restore.

    Returns {"stages": {stage: counts}, "totals": counts summed over stages}, where per stage:
    - samples_fed: samples of the distinct fed ids (the same for every stage);
    - samples_stepped: samples in the chosen lines' ids, a repeat counted each time;
    - samples_lost / lost_ids: fed ids the stage never summed;
    - samples_declared_lost: samples the stage itself said it gave up waiting for (`lost`), and
      samples_silently_lost: those of lost_ids it never declared (the worst kind), nor lost to a restore;
    - samples_doubled / doubled_ids: every count of an id past its first, across steps or within one;
    - samples_orphaned / orphan_ids: ids summed that no trainer reported fed (a trainer killed mid-microbatch);
    - steps, and divergent_steps: steps whose replicas (of one history) wrote different fingerprints;
    - restores: the stage's restore lines; steps_rolled_back: steps of abandoned histories;
    - samples_rolled_back / rolled_back_ids: lost ids an abandoned history had summed;
    - samples_lost_with_stage / lost_with_stage_ids: the other lost ids the stage held when it died;
    - samples_lost_with_leave / lost_with_leave_ids: the other lost ids a peer held, unstepped, when it left
      the stage (a `left` line): the last peers of a stage stopped together hold its unfinished step.
    Totals hold restores, steps_rolled_back, samples_rolled_back and samples_lost_with_stage only when
    the ledger has a restore line, and samples_lost_with_leave only when it has a `left` line.
    """
    ledger = _ReadLedger.of(fed_lines, step_lines)
    stages = {stage: _stage_counts(ledger, stage) for stage in ledger.stages()}
    summed_names = ["samples_lost", "samples_silently_lost", "samples_doubled", "samples_orphaned"]
    if ledger.restores:
        summed_names += ["restores", "steps_rolled_back", "samples_rolled_back", "samples_lost_with_stage"]
    if ledger.left:
        summed_names += ["samples_lost_with_leave"]
    totals = {
        "samples_fed": ledger.samples_fed,
        **{name: sum(counts[name] for counts in stages.values()) for name in summed_names},
        "divergent_steps": sum(len(counts["divergent_steps"]) for counts in stages.values()),
    }
    return {"stages": stages, "totals": totals}


@dataclass
class _ReadLedger:
    """The ledger's lines as `account` reads them: fed ids, step lines by history, restores by stage."""

    fed_sizes: dict[SampleKey, int]
    fed_times: dict[SampleKey, float]  # of the fed lines that have a time
    stage_times: dict[SampleKey, list[float]]  # of the fed lines that say when each stage served them
    steps_seen: list[dict[str, Any]]
    restores: dict[int, list[dict[str, Any]]]
    restore_times: dict[int, list[float]]  # per stage, sorted
    left: dict[int, dict[SampleKey, int]]  # per stage: ids peers held, unstepped, when they left it
    # kept history: (stage, step) -> peer -> line; abandoned ones: (stage, epoch, step) -> peer -> line
    replicas: dict[tuple[int, int], dict[str, dict[str, Any]]]
    abandoned: dict[tuple[int, int, int], dict[str, dict[str, Any]]]

    @classmethod
    def of(cls, fed_lines: Iterable[dict[str, Any]], step_lines: Iterable[dict[str, Any]]) -> _ReadLedger:
        fed_sizes: dict[SampleKey, int] = {}
        fed_times: dict[SampleKey, float] = {}
        stage_times: dict[SampleKey, list[float]] = {}
        for line in fed_lines:
            if line.get("kind") == "fed":
                key = (str(line["trainer"]), int(line["mb"]))
                fed_sizes[key] = int(line["samples"])
                if line.get("time") is not None:
                    fed_times[key] = float(line["time"])
                if line.get("stage_times") is not None:
                    stage_times[key] = [float(t) for t in line["stage_times"]]
        steps_seen: list[dict[str, Any]] = []
        restores: dict[int, list[dict[str, Any]]] = defaultdict(list)
        left: dict[int, dict[SampleKey, int]] = defaultdict(dict)
        for line in step_lines:
            if line.get("kind") == "step":
                steps_seen.append(line)
            elif line.get("kind") == "restore":
                restores[int(line["stage"])].append(line)
            elif line.get("kind") == "left":
                left[int(line["stage"])].update((_key(entry), int(entry[2])) for entry in line["ids"])
        restore_times = {stage: sorted(float(r["time"]) for r in group) for stage, group in restores.items()}
        replicas: dict[tuple[int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
        abandoned: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
        for line in steps_seen:
            stage, step, peer = int(line["stage"]), int(line["step"]), str(line["peer"])
            if _abandoned(line, restores.get(stage, [])):
                abandoned[stage, _epoch(line, restore_times[stage]), step][peer] = line
            else:
                replicas[stage, step][peer] = line  # the peer's last line wins
        return cls(fed_sizes, fed_times, stage_times, steps_seen, restores, restore_times, left, replicas, abandoned)

    def served_at(self, key: SampleKey, stage: int) -> float | None:
        """When `stage` served the microbatch's backward, as its trainer saw it (else when stage 0 did)."""
        times = self.stage_times.get(key)
        if times is not None and stage < len(times):
            return times[stage]
        return self.fed_times.get(key)

    @property
    def samples_fed(self) -> int:
        return sum(self.fed_sizes.values())

    def stages(self) -> list[int]:
        """Every stage that wrote a step or restore line, in order."""
        return sorted(
            {stage for stage, _ in self.replicas} | {stage for stage, _, _ in self.abandoned} | set(self.restores)
        )


@dataclass
class _StageTally:
    """What one stage's chosen lines hold, over its kept history and its abandoned ones."""

    summed: Counter[SampleKey] = field(default_factory=Counter)
    sizes: dict[SampleKey, int] = field(default_factory=dict)  # from the trainer's line; an orphan's from the step
    declared: set[SampleKey] = field(default_factory=set)
    undone: set[SampleKey] = field(default_factory=set)  # ids the abandoned histories summed
    steps: list[int] = field(default_factory=list)
    divergent: set[int] = field(default_factory=set)


def _tally(ledger: _ReadLedger, stage: int) -> _StageTally:
    """Reads the chosen line of every step of `stage`, kept history first, and the divergence among replicas."""
    tally = _StageTally(sizes=dict(ledger.fed_sizes))
    histories = [((step,), by_peer, True) for (s, step), by_peer in ledger.replicas.items() if s == stage]
    histories += [
        ((epoch, step), by_peer, False) for (s, epoch, step), by_peer in ledger.abandoned.items() if s == stage
    ]
    for where, by_peer, kept in sorted(histories, key=lambda h: (not h[2], h[0])):
        lines = list(by_peer.values())
        if len({line["fingerprint"] for line in lines}) > 1:
            tally.divergent.add(where[-1])
        chosen = _chosen_line(lines)
        if kept:
            tally.steps.append(where[-1])
        for entry in chosen["ids"]:
            (tally.summed if kept else tally.undone).update([_key(entry)])
            tally.sizes.setdefault(_key(entry), int(entry[2]))
        for entry in chosen["lost"]:
            tally.declared.add(_key(entry))
            tally.sizes.setdefault(_key(entry), int(entry[2]))
    return tally


def _reached(before: list[dict[str, Any]], last: int) -> float:
    """When the stage reached step `last` (wrote its line for `last - 1`): the earliest such line among the peers
    that wrote one for `last`, each peer's own. A peer that took a state at `last - 1` writes that line when it
    joins, seconds later than the stage got there (a wave run: a backward served in between, held toward
    `last + 1`, went uncounted). Without such peers, the latest line below `last`, as before."""
    own: dict[str, float] = {}
    stepped_last = {line.get("peer") for line in before if int(line["step"]) == last}
    for line in before:
        if int(line["step"]) == last - 1 and line.get("peer") in stepped_last:
            own[line["peer"]] = max(own.get(line["peer"], float("-inf")), float(line["time"]))
    if own:
        return min(own.values())
    return max((float(line["time"]) for line in before if int(line["step"]) <= last - 1), default=float("-inf"))


def _lost_with_stage(ledger: _ReadLedger, stage: int, lost: set[SampleKey]) -> set[SampleKey]:
    """Of `lost`, the ids whose backward `stage` served between the moment it reached the step of its last line
    before a restore and that restore."""
    windows = []
    for restored_at in ledger.restore_times.get(stage, []):
        before = [line for line in ledger.steps_seen if _written_before(line, stage, restored_at)]
        last = max((int(line["step"]) for line in before), default=0)
        # the moment the stage reached its last line's step: a microbatch fed earlier ran its forward before
        # then, so its backward (at most one step stale) was summed by that last line, or declared lost
        windows.append((_reached(before, last), restored_at))
    served = {key: ledger.served_at(key, stage) for key in lost}
    return {key for key, at in served.items() if at is not None and any(start < at < end for start, end in windows)}


def _stage_counts(ledger: _ReadLedger, stage: int) -> dict[str, Any]:
    """The counts `account` returns for one stage."""
    tally = _tally(ledger, stage)
    summed, sizes, declared = tally.summed, tally.sizes, tally.declared
    lost = set(ledger.fed_sizes) - set(summed)
    rolled_back = lost & tally.undone
    with_stage = _lost_with_stage(ledger, stage, lost - rolled_back)
    with_leave = (lost - rolled_back - with_stage) & set(ledger.left.get(stage, {}))
    doubled = {key: count - 1 for key, count in summed.items() if count > 1}
    orphans = {key: count for key, count in summed.items() if key not in ledger.fed_sizes}
    return {
        "samples_fed": ledger.samples_fed,
        "samples_stepped": _samples(summed, sizes),
        "steps": len(tally.steps),
        "samples_lost": sum(sizes[key] for key in lost),
        "lost_ids": _ids(lost),
        "samples_declared_lost": sum(sizes[key] for key in declared),
        "samples_silently_lost": sum(sizes[key] for key in lost - declared - rolled_back - with_stage - with_leave),
        "samples_lost_with_leave": sum(sizes[key] for key in with_leave - declared),
        "lost_with_leave_ids": _ids(with_leave - declared),
        "samples_doubled": _samples(doubled, sizes),
        "doubled_ids": _ids(doubled),
        "samples_orphaned": _samples(orphans, sizes),
        "orphan_ids": _ids(orphans),
        "divergent_steps": sorted(tally.divergent),
        "restores": len(ledger.restores.get(stage, [])),
        "steps_rolled_back": sum(1 for s, _, _ in ledger.abandoned if s == stage),
        "samples_rolled_back": sum(sizes[key] for key in rolled_back),
        "rolled_back_ids": _ids(rolled_back),
        "samples_lost_with_stage": sum(sizes[key] for key in with_stage),
        "lost_with_stage_ids": _ids(with_stage),
    }
