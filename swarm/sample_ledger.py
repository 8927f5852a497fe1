"""A ledger of samples by identity: which microbatches a trainer fed and which ones each stage stepped on.

A microbatch is named globally by (trainer id, microbatch id). With `--ledger FILE`, a trainer
appends one JSON line per microbatch whose backward reached stage 0 (`fed`), and a peer appends
one JSON line per step it applies: the ids summed into that step, those it gave up as lost, and
the fingerprint of the parameters after the step. Tools such as `scripts/chaos.py` read the lines
back to count, by id and per stage, what was lost or counted twice, and which replicas differ.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
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


def fed_record(trainer: str, microbatch: int, samples: int) -> dict[str, Any]:
    """A trainer's line: this microbatch went through every stage, forward and backward."""
    return {"kind": "fed", "trainer": trainer, "mb": microbatch, "samples": samples}


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


# ---------------------------------------------------------------------------------------------
# Reading the ledger back and accounting for every sample, by id and per stage.

SampleKey = tuple[str, int]  # (trainer, microbatch): the identity of a microbatch, without its size


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


def account(fed_lines: Iterable[dict[str, Any]], step_lines: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Accounts, per stage and by microbatch id, for the samples trainers fed and stages stepped on.

    For each (stage, step) one replica's line stands for the stage (see `_chosen_line`); the
    others only vote on divergence. A peer's repeated line for the same (stage, step) counts once
    (its last). Records of another kind in either input are ignored, so both may be the whole ledger.
    Returns {"stages": {stage: counts}, "totals": counts summed over stages}, where per stage:
    - samples_fed: samples of the distinct fed ids (the same for every stage);
    - samples_stepped: samples in the chosen lines' ids, a repeat counted each time;
    - samples_lost / lost_ids: fed ids the stage never summed;
    - samples_declared_lost: samples the stage itself said it gave up waiting for (`lost`), and
      samples_silently_lost: those of lost_ids it never declared (the worst kind);
    - samples_doubled / doubled_ids: every count of an id past its first, across steps or within one;
    - samples_orphaned / orphan_ids: ids summed that no trainer reported fed (a trainer killed mid-microbatch);
    - steps, and divergent_steps: steps whose replicas wrote different fingerprints.
    """
    fed_sizes: dict[SampleKey, int] = {}
    for line in fed_lines:
        if line.get("kind") == "fed":
            fed_sizes[(str(line["trainer"]), int(line["mb"]))] = int(line["samples"])
    samples_fed = sum(fed_sizes.values())

    replicas: dict[tuple[int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for line in step_lines:
        if line.get("kind") == "step":
            replicas[int(line["stage"]), int(line["step"])][str(line["peer"])] = line  # the peer's last line wins

    stages: dict[int, dict[str, Any]] = {}
    for stage in sorted({stage for stage, _ in replicas}):
        summed: Counter[SampleKey] = Counter()
        sizes = dict(fed_sizes)  # a size from the trainer's line; an orphan's from the step line
        declared: set[SampleKey] = set()
        steps, divergent = [], []
        for (s, step), by_peer in sorted(replicas.items()):
            if s != stage:
                continue
            steps.append(step)
            lines = list(by_peer.values())
            if len({line["fingerprint"] for line in lines}) > 1:
                divergent.append(step)
            chosen = _chosen_line(lines)
            for entry in chosen["ids"]:
                summed[_key(entry)] += 1
                sizes.setdefault(_key(entry), int(entry[2]))
            for entry in chosen["lost"]:
                declared.add(_key(entry))
                sizes.setdefault(_key(entry), int(entry[2]))
        lost = set(fed_sizes) - set(summed)
        doubled = {key: count - 1 for key, count in summed.items() if count > 1}
        orphans = {key: count for key, count in summed.items() if key not in fed_sizes}
        stages[stage] = {
            "samples_fed": samples_fed,
            "samples_stepped": _samples(summed, sizes),
            "steps": len(steps),
            "samples_lost": sum(sizes[key] for key in lost),
            "lost_ids": _ids(lost),
            "samples_declared_lost": sum(sizes[key] for key in declared),
            "samples_silently_lost": sum(sizes[key] for key in lost - declared),
            "samples_doubled": _samples(doubled, sizes),
            "doubled_ids": _ids(doubled),
            "samples_orphaned": _samples(orphans, sizes),
            "orphan_ids": _ids(orphans),
            "divergent_steps": divergent,
        }
    totals = {
        "samples_fed": samples_fed,
        **{
            name: sum(counts[name] for counts in stages.values())
            for name in ("samples_lost", "samples_silently_lost", "samples_doubled", "samples_orphaned")
        },
        "divergent_steps": sum(len(counts["divergent_steps"]) for counts in stages.values()),
    }
    return {"stages": stages, "totals": totals}
