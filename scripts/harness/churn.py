"""Churn on a local swarm: peers killed (one at a time, or a wave together) and started, counted as it goes.

Shared by scripts/chaos.py and scripts/bench_trainers.py; the swarm is gpt-tiny in `NUM_STAGES` stages.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from hivemind import DHT

from harness.churn_waves import wave_victims
from swarm.launch.local_swarm import LocalSwarm, reap
from swarm.records.stage_records import LEAVING, SERVING, StageRecord, fetch_stage_records

NUM_STAGES = 3
MODEL_FLAGS = ["--model", "gpt-tiny", "--num-stages", str(NUM_STAGES)]
PEER_FLAGS = [*MODEL_FLAGS, "--announce-period", "1", "--record-ttl", "6"]
RESTORED = re.compile(r"^(\S+) .*Restored stage (\d+) from a standby at step (\d+) \(lost (\d+) steps\)", re.M)


class RunFailed(RuntimeError):
    """A run could not go on: a trainer failed, or the swarm did not come up in time."""


class Churn:
    """Kills and starts peers of a LocalSwarm, keeping a count of what it did."""

    def __init__(
        self,
        swarm: LocalSwarm,
        dht: DHT,
        sig: int,
        rng: random.Random,
        ledger_dir: Path | None,
        peer_flags: list[str] = PEER_FLAGS,
        spare_last_peer: bool = False,
    ) -> None:
        self.swarm, self.dht, self.sig, self.rng, self.ledger_dir = swarm, dht, sig, rng, ledger_dir
        self.peer_flags = peer_flags
        self.spare_last_peer = spare_last_peer
        self.dead_ids: set[str] = set()  # peer ids killed: their records linger until they expire
        self.lost: dict[int, float] = {}  # stage -> when (time.monotonic) its last serving peer was killed
        # per stage death: the stage, seconds until one served it again, and the steps of progress lost
        self.losses: list[dict[str, Any]] = []
        self.died_at_step: dict[int, list[int]] = {}  # per stage, the step at each of its deaths
        self.serial = 0
        self.stage_of: dict[str, int] = {}
        self.process: dict[str, subprocess.Popen] = {}
        self.peer_ids: dict[str, str] = {}
        self.kills = self.starts = self.skipped = self.died = self.retired = 0
        self.events: list[tuple[float, str, int]] = []  # (wall clock, "start" or "kill", stage)
        # per wave: the live peers before it, those it killed, and the seconds it took (records read, all exited)
        self.waves: list[dict[str, Any]] = []

    def start(self, stage: int) -> str:
        """Starts a peer on `stage`; returns its name."""
        self.serial += 1
        name = f"peer{stage}-{self.serial}"
        ledger = ["--ledger", str(self.ledger_dir / f"{name}.jsonl")] if self.ledger_dir else []
        self.process[name] = self.swarm.start_peer(name, stage, [*self.peer_flags, *ledger])
        self.stage_of[name] = stage
        self.starts += 1
        self.events.append((round(time.time(), 3), "start", stage))
        return name

    def peer_id(self, name: str) -> str | None:
        if name not in self.peer_ids:  # read once found: logs grow, and this is asked every poll
            found = re.search(r"peer id (\w+)", self.swarm.log_path(name).read_text(errors="replace"))
            if not found:
                return None
            self.peer_ids[name] = found.group(1)
        return self.peer_ids[name]

    def forget_dead(self) -> None:
        """Drops peers that exited unasked (a crash is a finding: counted, and the stage left one short),
        and follows peers that moved to another stage (to restore a lost stage, or to rebalance)."""
        for name in [n for n in self.stage_of if self.process[n].poll() is not None]:
            del self.stage_of[name]
            self.died += 1
        self.follow_moves(fetch_stage_records(self.dht, "swarm", NUM_STAGES))

    def follow_moves(self, records: dict[int, list[StageRecord]]) -> None:
        """Puts each peer on the stage its records say it is on now: a peer that moved (to restore a lost stage,
        or to rebalance) is its new stage's peer, whose death may leave that stage empty."""
        now_on = {r.peer_id: stage for stage, group in records.items() for r in group if r.state != LEAVING}
        for name in self.stage_of:
            if (peer_id := self.peer_id(name)) in now_on:
                self.stage_of[name] = now_on[peer_id]

    def watch_lost(self) -> None:
        """Notes when each lost stage has a (live) serving peer again."""
        for stage, since in list(self.lost.items()):
            records = fetch_stage_records(self.dht, "swarm", NUM_STAGES, only=stage)[stage]
            live = [r for r in records if r.state == SERVING and r.peer_id not in self.dead_ids]
            if live:
                # the step it serves at again, against the step it died at: the progress the restore lost
                # (a stage that came back from scratch, with no "Restored" line, counts here too)
                died_at = self.died_at_step[stage][-1]
                back_at = max(r.step for r in live)
                self.losses.append(
                    {
                        "stage": stage,
                        "seconds_to_serving": round(time.monotonic() - since, 1),
                        "died_at_step": died_at,
                        "back_at_step": back_at,
                        "steps_lost": max(0, died_at - back_at),
                    }
                )
                del self.lost[stage]

    def serving(self, stage: int, records: list[StageRecord] | None = None) -> list[str]:
        """Names of this stage's live processes whose record says serving (a fresh record, not a dead one's);
        `records`: the stage's records where the caller has just fetched them."""
        if records is None:
            records = fetch_stage_records(self.dht, "swarm", NUM_STAGES, only=stage)[stage]
        serving = {r.peer_id for r in records if r.state == SERVING}
        alive = [n for n, s in self.stage_of.items() if s == stage and self.process[n].poll() is None]
        return [n for n in alive if self.peer_id(n) in serving]

    def layout(self) -> list[int]:
        return [sum(s == stage for s in self.stage_of.values()) for stage in range(NUM_STAGES)]

    def kill(self, name: str) -> bool:
        """Kills one peer (see `kill_together`); False where it was spared."""
        return bool(self.kill_together([name]))

    def kill_together(self, names: list[str]) -> list[str]:
        """Takes `names` down at once and returns those killed: every signal goes out before any exit is waited
        for, so a wave lands within a moment. With `spare_last_peer`, a stage's last serving peer (counting the
        mates this call kills) and a peer still joining are skipped."""
        records = fetch_stage_records(self.dht, "swarm", NUM_STAGES)
        # a restorer serves the stage it restored: counted there, a wave that kills it loses that stage
        self.follow_moves(records)
        serving = {stage: self.serving(stage, records[stage]) for stage in range(NUM_STAGES)}
        doomed: list[str] = []
        lost: list[int] = []
        for name in names:
            stage = self.stage_of[name]
            if self.spare_last_peer and (name not in serving[stage] or len(serving[stage]) < 2):
                self.skipped += 1
                continue
            doomed.append(name)
            if serving[stage] == [name] and stage not in self.lost:
                lost.append(stage)  # its last serving peer: the stage's state lives on in standbys
            serving[stage] = [n for n in serving[stage] if n != name]
        for name in doomed:
            self.swarm.signal(name, self.sig)
        deadline = time.monotonic() + 30
        for name in doomed:  # as LocalSwarm.stop does, with one deadline for all: they exit side by side
            reap(self.swarm.processes.pop(name), max(0.1, deadline - time.monotonic()))
        for name in doomed:
            if self.peer_id(name):
                self.dead_ids.add(self.peer_id(name))
            self.kills += 1
            self.events.append((round(time.time(), 3), "kill", self.stage_of.pop(name)))
        for stage in lost:
            self.lost[stage] = time.monotonic()
            self.events.append((round(time.time(), 3), "stage lost", stage))
            # the step it died at, as its records said: what a restore from a copy falls short of
            self.died_at_step.setdefault(stage, []).append(max((r.step for r in records[stage]), default=0))
        return doomed

    def wave(self, share: float) -> int:
        """Kills a random `share` of the live peers together (see harness.churn_waves); returns how many died."""
        live = [name for name in self.stage_of if self.process[name].poll() is None]
        started = time.monotonic()
        killed = self.kill_together(wave_victims(live, share, self.rng))
        self.waves.append(
            {"live_before": len(live), "killed": len(killed), "seconds": round(time.monotonic() - started, 2)}
        )
        return len(killed)

    def restores(self) -> list[dict[str, Any]]:
        """Every "Restored stage" line in the peers' logs, in time order: the stage, the step it came back at,
        the steps lost as that peer saw them, and the peer. The report's steps lost come from the records
        (`losses`): a line is one peer's view, and a stage brought back from scratch logs none."""
        found = []
        for name in self.process:
            text = self.swarm.log_path(name).read_text(errors="replace")
            for clock, stage, step, lost in RESTORED.findall(text):
                found.append((clock, int(stage), int(step), int(lost), name))
        return [
            {"stage": stage, "step": step, "steps_lost_logged": logged, "peer": name}
            for _, stage, step, logged, name in sorted(found)
        ]

    def kill_random(self) -> None:
        if self.stage_of:
            name = self.rng.choice(sorted(self.stage_of))
            stage = self.stage_of[name]
            if self.kill(name):
                self.start(stage)

    def least_served_stage(self) -> int:
        return min(range(NUM_STAGES), key=lambda stage: sum(s == stage for s in self.stage_of.values()))

    def wait_serving(self, timeout: float) -> None:
        """Waits until every live peer serves (none still joining) and every stage has one."""
        deadline = time.monotonic() + timeout
        while True:
            self.forget_dead()
            layout = self.layout()
            if all(len(self.serving(stage)) == layout[stage] > 0 for stage in range(NUM_STAGES)):
                return
            if time.monotonic() > deadline:
                raise RunFailed(f"peers not all serving after {timeout:.0f}s (layout {layout})")
            time.sleep(0.5)

    def restore(self, layout: list[int], timeout: float) -> None:
        """Brings every stage back to `layout`'s peer count (extra peers leave gracefully), all serving."""
        self.forget_dead()
        for stage, wanted in enumerate(layout):
            for _ in range(wanted - self.layout()[stage]):
                self.start(stage)
        self.wait_serving(timeout)
        for stage, wanted in enumerate(layout):
            for name in sorted(self.serving(stage))[: max(0, self.layout()[stage] - wanted)]:
                self.swarm.stop(name, signal.SIGTERM, timeout=30)
                del self.stage_of[name]
                self.retired += 1
