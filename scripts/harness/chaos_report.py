"""The parts of scripts/chaos.py's report read from a finished run: every live replica's step and
fingerprint, the sample ledgers, the spot checks, and the runs summed up."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P, PeerID

from harness.churn import Churn
from swarm.net.transport import get_peer_info
from swarm.records.sample_ledger import account, read_ledger

IDS_SHOWN = 20  # microbatch ids listed per stage and kind in the report; the counts cover them all
CAUSES = ("stage lost", "kill", "start")  # churn events, weightiest first: a step slowed near several goes to the first
CAUSE_WINDOW_S = 3.0  # an event this long before a step began, or while it ran, may have slowed it


async def _peer_infos(initial_peers: list[str], peer_ids: dict[str, str]) -> dict[str, Any]:
    p2p = await P2P.create(initial_peers=initial_peers)
    try:
        infos = {}
        for name, peer_id in peer_ids.items():
            try:
                infos[name] = await get_peer_info(p2p, PeerID.from_base58(peer_id))
            except Exception:
                continue  # gone or busy: it is not counted among the replicas checked
        return infos
    finally:
        await p2p.shutdown()


def end_state(churn: Churn, initial_peers: list[str], timeout: float) -> dict[str, Any]:
    """Every live peer's step and parameter fingerprint once the swarm is quiet, and the replicas that differ.

    The last steps' averaging rounds finish just after the trainers' last replies, so this asks
    again (up to `timeout`) until no peer holds samples and every stage's replicas are at one step.
    """
    deadline = time.monotonic() + timeout
    while True:
        churn.forget_dead()
        ids = {name: pid for name in churn.stage_of if (pid := churn.peer_id(name))}
        infos = asyncio.run(_peer_infos(initial_peers, ids))
        by_stage: dict[int, list[Any]] = {}
        for info in infos.values():
            by_stage.setdefault(info.stage, []).append(info)
        settled = all(info.samples_accumulated == 0 for info in infos.values()) and all(
            len({info.step for info in group}) == 1 for group in by_stage.values()
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    divergent = behind = 0
    for group in by_stage.values():
        top = max(info.step for info in group)
        behind += sum(info.step < top for info in group)
        for step in {info.step for info in group}:
            fingerprints = Counter(info.fingerprint for info in group if info.step == step)
            divergent += sum(fingerprints.values()) - max(fingerprints.values())  # all but the majority
    return {
        "settled": settled,
        "replicas_checked": len(infos),
        "fingerprints_missing": sum(not info.fingerprint for info in infos.values()),
        "divergent_replicas": divergent,
        "replicas_behind": behind,
        "steps_per_stage": {stage: sorted({i.step for i in g}) for stage, g in sorted(by_stage.items())},
        "samples_stepped_per_stage": {
            stage: max(i.samples_stepped for i in g) for stage, g in sorted(by_stage.items())
        },
        "peer_counters": {
            name: sum(getattr(info, name) for info in infos.values())
            for name in ("samples_lost", "samples_doubled", "divergences", "resyncs", "stale_gradients")
        },
    }


def ledger_report(ledger_dir: Path) -> dict[str, Any]:
    """The run's ledger accounted for (see swarm.records.sample_ledger.account), ids cut to the first few."""
    records = read_ledger(sorted(ledger_dir.glob("*.jsonl")))
    accounted = account(records, records)
    stages = accounted["stages"]
    return {
        "samples_fed": accounted["totals"]["samples_fed"],
        "totals": accounted["totals"],
        **{
            f"{name}_per_stage": {stage: counts[name] for stage, counts in stages.items()}
            for name in (
                "samples_stepped",
                "samples_lost",
                "samples_doubled",
                "samples_orphaned",
                "samples_silently_lost",
                "samples_declared_lost",
                "samples_rolled_back",
                "samples_lost_with_stage",
                "samples_lost_with_leave",
            )
        },
        "divergent_steps_per_stage": {stage: counts["divergent_steps"] for stage, counts in stages.items()},
        "ids": {
            stage: {
                kind: counts[f"{kind}_ids"][:IDS_SHOWN]
                for kind in ("lost", "doubled", "orphan", "rolled_back", "lost_with_stage", "lost_with_leave")
            }
            for stage, counts in stages.items()
        },
    }


def spot_check_report(workdir: Path) -> dict[str, Any]:
    """What the trainers' spot checks did (summed over their summaries), and every peer accused in a log."""
    counts: Counter[str] = Counter()
    for summary in workdir.glob("trainer-*.json"):
        counts.update(json.loads(summary.read_text()).get("spot_checks", {}))
    accused = set()
    for log in workdir.glob("*.log"):
        accused.update(re.findall(r"peer (\w+) of stage \d+ is accused by trainer", log.read_text(errors="replace")))
    return {**counts, "peers_accused": sorted(accused)}


def time_lost_by_cause(
    step_ends: list[list[float]],
    events: list[tuple[float, str, int]],
    typical_step: float,
    until: float | None = None,
    window: float = CAUSE_WINDOW_S,
) -> dict[str, float]:
    """Where the churn's time went: the seconds each trainer's steps took beyond `typical_step` (the no-churn
    median), averaged over the trainers. A step's excess goes to the weightiest churn event (`CAUSES`) from
    `window` seconds before it began to its end, else to "none" (steps slower with no event near: copies following
    their stages, a busier host). `step_ends` holds, per trainer, its start then each step's end; all times and
    `until` (steps ending later are left out) are wall clock, as the events'."""
    lost = dict.fromkeys([*CAUSES, "none"], 0.0)
    for ends in step_ends:
        for begin, end in zip(ends, ends[1:]):
            if until is not None and end > until:
                break
            if (excess := end - begin - typical_step) > 0:
                near = {kind for at, kind, _ in events if begin - window <= at <= end}
                lost[next((c for c in CAUSES if c in near), "none")] += excess / len(step_ends)
    return {cause: round(seconds, 1) for cause, seconds in lost.items()}


def totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs summed up: counts added, the worst stall, throughput fractions' mean and minimum."""
    done = [run for run in runs if "error" not in run]
    ledgers = [run["ledger"]["totals"] for run in done if "ledger" in run]
    fractions = [run["throughput_fraction"] for run in done]
    total: dict[str, Any] = {
        "runs": len(runs),
        "runs_failed": len(runs) - len(done),
        "runs_with_gap_over_30s": sum(run.get("stall_over_30s", False) for run in runs),
        "longest_stall_s": max((run.get("longest_stall_s", 0.0) for run in runs), default=0.0),
        **{
            name: sum(run.get(name, 0) for run in runs)
            for name in ("kills", "steps", "steps_requested", "stages_lost", "stages_restored_from_standby")
        },
        "steps_lost_per_restore": [n for run in runs for n in run.get("steps_lost_per_restore", [])],
        "seconds_to_serving_again": [s for run in runs for s in run.get("seconds_to_serving_again", [])],
        "throughput_fraction_mean": round(sum(fractions) / len(fractions), 3) if fractions else None,
        "throughput_fraction_min": min(fractions, default=None),
        "divergent_replicas_end": sum(run["end"]["divergent_replicas"] for run in done),
        "replicas_checked_end": sum(run["end"]["replicas_checked"] for run in done),
    }
    if cpu := [run["host_cpu"]["churn"] for run in done if "churn" in run.get("host_cpu", {})]:
        total["host_cpu_churn"] = {  # each run's share (harness.host_cpu), the runs in order
            name: [c[name] for c in cpu] for name in ("share_of_cores", "starting_share", "starting_cpu_s_per_start")
        }
    if lost := [run["seconds_lost_by_cause"] for run in done if "seconds_lost_by_cause" in run]:
        total["seconds_lost_by_cause"] = {cause: round(sum(run[cause] for run in lost), 1) for cause in lost[0]}
    if any("waves" in run for run in runs):  # wave mode
        total["waves"] = sum(run.get("waves", 0) for run in runs)
        total["peers_killed_per_wave"] = [n for run in runs for n in run.get("peers_killed_per_wave", [])]
    if ledgers:
        for name in ("samples_fed", "samples_lost", "samples_doubled", "samples_orphaned", "samples_silently_lost"):
            total[name] = sum(ledger[name] for ledger in ledgers)
        # a ledger has these only when a stage was restored from a standby, or a peer left holding samples
        for name in ("steps_rolled_back", "samples_rolled_back", "samples_lost_with_stage", "samples_lost_with_leave"):
            total[name] = sum(ledger.get(name, 0) for ledger in ledgers)
        total["divergent_steps"] = sum(ledger["divergent_steps"] for ledger in ledgers)
    return total
