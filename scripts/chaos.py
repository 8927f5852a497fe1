"""Runs a local swarm under failures and reports how training held up; prints one JSON object.

Three kinds of churn:
- `--kill-every S`: every S seconds (randomised, exponential) a random peer gets SIGKILL (or
  SIGTERM with `--signal term`) and a replacement for its stage is started at once.
- `--wave SHARE`: preemption waves. Every `--wave-every` seconds a random SHARE of the live peers
  (rounded half up, at least one) is taken down together, every signal sent before any exit is
  awaited; `--refill-after` seconds later as many peers start, each on the stage with the fewest. As
  in kill mode, the swarm starts, and its baselines run, with `--peers-per-stage` peers per stage, and
  the churn lasts as long as the trainers take for the steps the baseline would do in `--duration`.
  The report counts the waves and, per wave, the live peers before it, those it killed and the
  seconds its kills took.
- `--trace FILE`: a spot availability trace (`time_ms,add|remove,node` lines, as in
  ../shared/traces) replayed compressed into `--trace-minutes`: the trace's live node count, scaled
  so that its peak is `--max-peers`, is followed by starting peers (on the stage with the fewest)
  and SIGKILLing random ones. The swarm starts, and its baselines run, with the trace's mean live
  count (weighted by time): on a machine whose cores all peers share, a swarm's speed depends on
  how many peers it has (more peers average more and compute no faster), so a baseline at another
  size would measure the size, not the churn. Throughput under churn is measured over the trace's
  window only: the trainers finish their steps after it with no churn.

With `--spare-last-peer no` (the default) the churn kills whatever peer it picks, a stage's last
one included: the stage comes back from a standby copy (`swarm.peer.standby`), and the report
counts the stages lost and served again, the steps of progress each restore lost (from the peers'
"Restored stage" lines) and the seconds from a stage's death to a peer serving it again. With
`--spare-last-peer yes`, a stage's last serving peer is never killed (skipped kills are counted).

Each of `--runs` runs is a fresh local swarm: `--trainers` trainers (each on its own shard of the
standard library when there are several) train `--warmup-steps` steps unmeasured (the swarm takes its
standby copies), then with no churn to measure the baseline, then through
the churn, then, with the starting layout restored (and, where that started peers, `--warmup-steps`
unmeasured again while they join), with no churn again (throughput drifts as a
swarm warms up and its model trains, so one baseline alone would flatter or blame the churn). Every
process writes a sample ledger (`--ledger`) in the run's folder. The report gives, per run and in
total: steps, samples/s over time, throughput under churn against the mean of the two baselines,
retries, bans, resent samples, the longest stall between steps and the runs with a stall over 30 s;
from the ledger, per stage and by microbatch id, samples lost (those a restore from a standby rolled
back or that died with their stage named apart), counted twice and orphaned, and steps whose
replicas wrote different fingerprints; and at the end, every live peer's parameter
fingerprint, replicas of a stage at one step that differ counted as divergent. Per phase, `host_cpu`
says where the machine's CPU went (`harness.host_cpu`): its share of the cores, the share taken by
processes in their first seconds (the replacements' starts) and their CPU per start, and the CPU per
sample of the rest. `seconds_lost_by_cause` says where the churn's time went: the seconds the trainers'
steps took beyond the no-churn median, each slow step charged to the weightiest churn event near it (a
stage lost, a kill, a start) or to none (`harness.chaos_report.time_lost_by_cause`).

Every process of a run shares this machine's cores. A peer launched as a program spends about 2 s of CPU
importing torch and hivemind before it does anything, taken from the peers that train; a trace replay
starts a peer every few seconds. So by default (`--preload yes`) peers are forked from a process that
imported them once, as the demo's are, and a start costs what it would cost a peer on its own machine.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from harness.chaos_report import end_state, ledger_report, spot_check_report, time_lost_by_cause, totals
from harness.churn import MODEL_FLAGS, NUM_STAGES, PEER_FLAGS, Churn, RunFailed  # bench_trainers.py's too, from here
from harness.host_cpu import HostCpu, phase_cpu
from harness.spot_trace import live_peer_targets, mean_live_peers
from swarm.config import PeerConfig, TrainerConfig
from swarm.launch.local_swarm import LocalSwarm
from swarm.net.dht_node import TetheredDHT
from swarm.trust.vouchers import load_root_key, make_root_key, make_voucher

TRAINER_FLAGS = [*MODEL_FLAGS, "--compression", "none", "--stage-wait-timeout", "300", "--no-progress"]
STALL_BOUND = 30.0  # seconds between two steps: a run with a longer gap is counted
# disjoint corners of the standard library, one per trainer, each large enough for gpt-tiny
SHARDS = ["asyncio", "email", "unittest", "xml", "multiprocessing", "tkinter", "idlelib", "http"]
READY = re.compile(r"Found all \d+ stages")  # the trainer's log line just before its clock starts
POLL = 0.2  # seconds between looks at the processes: short against a step (about a second)


def supports_ledger() -> bool:
    """Whether this checkout's peers and trainers take `--ledger` (the sample ledger)."""
    return all("ledger" in {f.name for f in fields(config)} for config in (PeerConfig, TrainerConfig))


def shard(index: int) -> list[str]:
    """`--data` flags for the trainer numbered `index`: a corner of the standard library of its own."""
    if index >= len(SHARDS):
        raise SystemExit(f"at most {len(SHARDS)} trainers (one data shard each)")
    return ["--data", str(Path(sysconfig.get_paths()["stdlib"]) / SHARDS[index])]


@dataclass
class TrainerRun:
    """One trainer process, and when (time.monotonic) its clock started and it exited."""

    name: str
    process: subprocess.Popen
    log: Path
    summary_file: Path
    ledger: Path | None
    launched: float = 0.0  # time.monotonic() when the process was started
    ready: float | None = None  # when its log said it found the swarm: its summary's clock starts there
    ended: float | None = None
    summary: dict[str, Any] | None = None

    def poll(self) -> bool:
        """Notes what the trainer has done since the last look; True while it runs."""
        now = time.monotonic()
        if self.ready is None and self.log.exists() and READY.search(self.log.read_text(errors="replace")):
            self.ready = now
        if self.ended is None and self.process.poll() is not None:
            self.ended = now
        return self.ended is None

    @property
    def start(self) -> float:
        """When its first step began; without the log line, its exit less the seconds it trained."""
        assert self.summary is not None and self.ended is not None
        return self.ready if self.ready is not None else self.ended - self.summary["seconds"]

    def samples_by(self, moment: float) -> float:
        """Samples done by `moment`, interpolated within steps (its summary gives each step's end)."""
        assert self.summary is not None
        per_step = self.summary["samples"] / max(1, self.summary["steps"])
        points = [(self.start, 0.0)] + [
            (self.start + t, per_step * (i + 1)) for i, t in enumerate(self.summary["step_seconds"])
        ]
        if moment <= points[0][0]:
            return 0.0
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if moment <= t1:
                return s0 + (s1 - s0) * (moment - t0) / max(t1 - t0, 1e-9)
        return points[-1][1]


def start_trainer(
    swarm: LocalSwarm, name: str, steps: int, workdir: Path, ledger_dir: Path | None, data: list[str]
) -> TrainerRun:
    """Starts `swarm train` for `steps` steps with a summary file (and a ledger, if `ledger_dir`); `data` holds
    its flags beyond the common ones."""
    summary_file = workdir / f"{name}.json"
    ledger = ledger_dir / f"{name}.jsonl" if ledger_dir else None
    flags = [*TRAINER_FLAGS, "--steps", str(steps), "--summary-file", str(summary_file), *data]
    if ledger:
        flags += ["--ledger", str(ledger)]
    launched = time.monotonic()
    process = swarm.start_trainer(name, flags)
    return TrainerRun(name, process, swarm.log_path(name), summary_file, ledger, launched=launched)


def run_trainers(
    swarm: LocalSwarm,
    phase: str,
    count: int,
    steps: int,
    workdir: Path,
    ledger_dir: Path | None,
    timeout: float,
    meanwhile: Callable[[float], None] | None = None,
    sharded: bool = True,
    extra: tuple[str, ...] = (),
    on_start: Callable[[list[TrainerRun]], None] | None = None,
) -> list[TrainerRun]:
    """Runs `count` trainers at once, `steps` steps each, calling `meanwhile(seconds since start)` as they go.

    Each trainer reads its own shard of the data, unless not `sharded` (all read the default corpus), and
    takes the `extra` flags; `on_start` hears of them once all have started.
    """
    runs = [
        start_trainer(
            swarm, f"trainer-{phase}-{i}", steps, workdir, ledger_dir, [*(shard(i) if sharded else []), *extra]
        )
        for i in range(count)
    ]
    if on_start is not None:
        on_start(runs)
    started = time.monotonic()
    while any([run.poll() for run in runs]):  # a list: every trainer is polled each time
        if time.monotonic() - started > timeout:
            raise RunFailed(f"{phase} trainers still running after {timeout:.0f}s")
        if meanwhile is not None:
            meanwhile(time.monotonic() - started)
        time.sleep(POLL)
    for run in runs:
        if run.process.returncode != 0:
            raise RunFailed(f"{run.name} exited {run.process.returncode}; see {run.log}")
        run.summary = json.loads(run.summary_file.read_text())
    return runs


def concurrent_rate(runs: list[TrainerRun], until: float | None = None) -> tuple[float, float]:
    """Samples/s of trainers together while all of them ran (and before `until`), and that window's
    share of the whole span.

    The sum of each trainer's own rate would credit a trainer that finished early with the speed the
    others then had alone; the window counts only the time they shared.
    """
    starts = [run.start for run in runs]
    ends = [run.start + run.summary["seconds"] for run in runs]
    low, high = max(starts), min([*ends, until if until is not None else float("inf")])
    if high - low <= 0:  # never all at once
        return sum(run.summary["samples_per_second"] for run in runs), 0.0
    rate = sum(run.samples_by(high) - run.samples_by(low) for run in runs) / (high - low)
    return rate, (high - low) / max(max(ends) - min(starts), 1e-9)


def stall(runs: list[TrainerRun]) -> float:
    """The longest gap between two steps of one trainer (its start counts as a step)."""
    gaps = []
    for run in runs:
        times = [0.0, *run.summary["step_seconds"]]
        gaps += [b - a for a, b in zip(times, times[1:])]
    return max(gaps, default=0.0)


def samples_over_time(runs: list[TrainerRun], window: float = 10.0) -> list[float]:
    """Samples/s of all trainers together in consecutive windows from the first one's start."""
    origin = min(run.start for run in runs)
    done = []
    for run in runs:
        per_step = run.summary["samples"] / max(1, run.summary["steps"])
        done += [(run.start + t - origin, per_step) for t in run.summary["step_seconds"]]
    end = max((t for t, _ in done), default=0.0)
    return [
        round(sum(n for t, n in done if start <= t < start + window) / window, 2)
        for start in [i * window for i in range(int(end // window) + 1)]
    ]


def one_run(args: argparse.Namespace, index: int, workdir: Path, report: dict[str, Any]) -> None:
    """One fresh swarm: baseline, churn, baseline again, end state; fills `report` as it goes."""
    rng = random.Random(args.seed * 1_000_003 + index)
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGTERM
    ledger_dir = workdir / "ledger" if supports_ledger() else None
    if ledger_dir:
        ledger_dir.mkdir(parents=True)
    report["workdir"] = str(workdir)
    with LocalSwarm(workdir, preloaded=args.preload == "yes") as swarm, HostCpu() as cpu:
        swarm.start_bootstrap()
        dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)  # ends with this process
        peer_trust, trainer_trust = trust_flags(args, workdir)
        try:
            spare = args.spare_last_peer == "yes"
            churn = Churn(swarm, dht, sig, rng, ledger_dir, [*PEER_FLAGS, *peer_trust], spare_last_peer=spare)
            phases = RunPhases(args, swarm, churn, rng, workdir, ledger_dir, report, trainer_trust, cpu)
            layout = phases.start_peers()
            # unmeasured: the swarm takes its standby copies (first taken once a stage is --standby-every steps in),
            # so that the baseline trains the swarm the churn and the baseline after it train, copies and all
            warmup = phases.trainers("warmup", args.warmup_steps) if args.warmup_steps else []
            before = phases.trainers("before", args.baseline_steps)
            before_rate, _ = concurrent_rate(before)
            report["baseline_before_samples_per_s"] = round(before_rate, 2)
            churned, churn_rate = phases.under_churn(before_rate, before[0].summary)
            started = churn.starts
            churn.restore(layout, 300)  # the same peers per stage as the first baseline had
            # unmeasured, as the warmup: the peers the restore started take their state and copies first (measured
            # while they did, the baseline after ran 15-20% below the one before, a sixth of its CPU theirs)
            restarted = args.warmup_steps and churn.starts > started
            settle = phases.trainers("settle", args.warmup_steps) if restarted else []
            after = phases.trainers("after", args.baseline_steps)
            after_rate, _ = concurrent_rate(after)
            baseline = (before_rate + after_rate) / 2
            report.update(
                baseline_after_samples_per_s=round(after_rate, 2),
                baseline_samples_per_s=round(baseline, 2),
                throughput_fraction=round(churn_rate / baseline, 3),
                samples_fed_by_trainers=sum(
                    r.summary["samples"] for r in [*warmup, *before, *churned, *settle, *after]
                ),
            )
            report["end"] = end_state(churn, swarm.initial_peers, 60)
            report["peers_died_unasked"] = churn.died
            report["peers_retired_for_baseline"] = churn.retired
        finally:
            dht.shutdown()
    # every process has stopped: the ledger files are complete
    if ledger_dir:
        report["ledger"] = ledger_report(ledger_dir)
    if args.trust_root == "yes":
        report["spot_checks"] = spot_check_report(workdir)


def trust_flags(args: argparse.Namespace, workdir: Path) -> tuple[list[str], list[str]]:
    """With --trust-root yes: the peers' and the trainers' flags for a trust root made in `workdir`, the trainers
    with a voucher of it (and --spot-check-share where given); else none."""
    if args.trust_root != "yes":
        return [], []
    public = make_root_key(workdir / "root.key")
    make_voucher(load_root_key(workdir / "root.key"), "chaos-trainer", workdir / "trainer.voucher")
    trainer = ["--trust-root", public, "--voucher", str(workdir / "trainer.voucher")]
    if args.spot_check_share is not None:
        trainer += ["--spot-check-share", str(args.spot_check_share)]
    return ["--trust-root", public], trainer


class RunPhases:
    """The steps of one run on its started swarm: the starting peers, the trainers of each phase, the churn."""

    def __init__(
        self,
        args: argparse.Namespace,
        swarm: LocalSwarm,
        churn: Churn,
        rng: random.Random,
        workdir: Path,
        ledger_dir: Path | None,
        report: dict[str, Any],
        trainer_flags: list[str] | None = None,
        cpu: HostCpu | None = None,
    ) -> None:
        self.args, self.swarm, self.churn, self.rng, self.cpu = args, swarm, churn, rng, cpu
        self.workdir, self.ledger_dir, self.report = workdir, ledger_dir, report
        self.trainer_flags = tuple(trainer_flags or ())  # beyond the common ones: a trust root's
        self.trace: list[tuple[float, int]] = []  # with --trace: (seconds, live peers wanted) still to replay
        self.next_kill = 0.0  # in kill mode: seconds into the churn of the next kill
        self.next_wave = 0.0  # with --wave: seconds into the churn of the next wave
        self.refills: list[tuple[float, int]] = []  # with --wave: (seconds into the churn, peers to start) due

    def start_peers(self) -> list[int]:
        """Starts the swarm's peers and waits until they serve; returns the layout (reported as the baseline's)."""
        args, churn = self.args, self.churn
        if args.trace:
            self.trace = live_peer_targets(args.trace, args.trace_minutes, args.max_peers, min_peers=3)
            # the swarm at its mean size over the replay; what the trace does at its first instant
            # (nodes coming up) is that starting swarm, not churn
            mean = mean_live_peers(self.trace, args.trace_minutes * 60)
            self.report["trace_mean_live_peers"] = round(mean, 2)
            while self.trace and self.trace[0][0] <= 0:
                self.trace.pop(0)
            for i in range(max(NUM_STAGES, round(mean))):
                churn.start(i % NUM_STAGES)
        else:
            for stage in range(NUM_STAGES):
                for _ in range(args.peers_per_stage):
                    churn.start(stage)
        churn.wait_serving(300)
        layout = churn.layout()
        self.report["baseline_layout"] = layout
        return layout

    def trainers(self, phase: str, steps: int, meanwhile: Callable[[float], None] | None = None) -> list[TrainerRun]:
        """Runs the phase's trainers to the end: one reads the default corpus, as chaos runs always did; several
        get a shard each."""
        args, cpu, starts = self.args, self.cpu, self.churn.starts
        before, started = cpu.snapshot() if cpu else {}, time.monotonic()
        runs = run_trainers(
            self.swarm,
            phase,
            args.trainers,
            steps,
            self.workdir,
            self.ledger_dir,
            args.phase_timeout,
            meanwhile,
            sharded=args.trainers > 1,
            extra=self.trainer_flags,
            on_start=(lambda runs: cpu.trainers.update(run.process.pid for run in runs)) if cpu else None,
        )
        if cpu is not None:  # where the phase's CPU went (harness.host_cpu)
            samples = sum(run.summary["samples"] for run in runs)
            used = phase_cpu(before, cpu.snapshot(), time.monotonic() - started, samples, self.churn.starts - starts)
            self.report.setdefault("host_cpu", {})[phase] = used
        return runs

    def under_churn(self, before_rate: float, before_summary: dict[str, Any]) -> tuple[list[TrainerRun], float]:
        """Trains through the churn the steps the baseline would train in its duration; returns the trainers
        and their samples/s under churn (over the trace's window only, with a trace)."""
        args, churn, report = self.args, self.churn, self.report
        duration = args.trace_minutes * 60 if args.trace else args.duration
        per_step = before_summary["samples"] / max(1, before_summary["steps"])
        # the steps each trainer would train in `duration` at the baseline; churn goes on until they are done
        steps = max(1, int(before_rate / args.trainers * duration / per_step))
        report["steps_requested"] = steps * args.trainers
        self.next_kill = self.rng.expovariate(1 / args.kill_every)
        self.next_wave = args.wave_every
        churn_started = time.time()
        try:
            churned = self.trainers("churn", steps, self._churn_step)
        finally:
            restores = churn.restores()
            report.update(
                kills=churn.kills,
                kills_skipped_last_peer=churn.skipped,
                spare_last_peer=churn.spare_last_peer,
                stages_lost=len(churn.losses) + len(churn.lost),
                stages_served_again=len(churn.losses),
                stages_restored_from_standby=len(restores),
                steps_lost_per_restore=[loss["steps_lost"] for loss in churn.losses],
                seconds_to_serving_again=[loss["seconds_to_serving"] for loss in churn.losses],
                restores=restores,
                peers_started=churn.starts,
                trace_targets_not_replayed=len(self.trace) if args.trace else None,
                churn_events=[e for e in churn.events if e[0] >= churn_started],
            )
            if args.wave:
                report.update(
                    waves=len(churn.waves),
                    peers_killed_per_wave=[wave["killed"] for wave in churn.waves],
                    peers_live_before_wave=[wave["live_before"] for wave in churn.waves],
                    seconds_per_wave=[wave["seconds"] for wave in churn.waves],
                    refills_not_started=sum(count for _, count in self.refills),
                )
        # with a trace, only its window is churn: after it the trainers finish with the swarm left as it is
        window_end = churned[0].launched + duration if args.trace else None
        wall = time.time() - time.monotonic()  # the trainers' clocks are monotonic, the churn's events wall clock
        before_steps = before_summary["step_seconds"]
        report["seconds_lost_by_cause"] = time_lost_by_cause(
            [[wall + r.start + t for t in [0.0, *r.summary["step_seconds"]]] for r in churned],
            report["churn_events"],
            statistics.median(b - a for a, b in zip([0.0, *before_steps], before_steps)),
            until=wall + window_end if window_end else None,
        )
        return churned, self._report_churned(churned, window_end)

    def _churn_step(self, now: float) -> None:
        """What the churn does `now` seconds in: the trace's next targets, the next wave and refill, or the next
        random kill."""
        churn, trace = self.churn, self.trace
        churn.watch_lost()
        if self.args.trace:  # once the trace is all replayed, the swarm stays as it is
            while trace and trace[0][0] <= now:
                _, wanted = trace.pop(0)
                while len(churn.stage_of) < wanted:
                    churn.start(churn.least_served_stage())
                for name in churn.rng.sample(sorted(churn.stage_of), len(churn.stage_of)):
                    if len(churn.stage_of) <= wanted:
                        break
                    churn.kill(name)
        elif self.args.wave:
            self._wave_step(now)
        elif now >= self.next_kill:
            churn.kill_random()
            self.next_kill = now + self.rng.expovariate(1 / self.args.kill_every)

    def _wave_step(self, now: float) -> None:
        """Starts the replacements whose time has come, each on the stage with the fewest peers, then the wave
        whose time has come."""
        churn = self.churn
        while self.refills and self.refills[0][0] <= now:
            _, count = self.refills.pop(0)
            for _ in range(count):
                churn.start(churn.least_served_stage())
        if now >= self.next_wave:
            killed = churn.wave(self.args.wave)
            # times from after the wave: on a loaded machine its kills take a moment, and the refill waits them out
            done = now + churn.waves[-1]["seconds"]
            self.refills.append((done + self.args.refill_after, killed))
            self.next_wave = done + self.args.wave_every

    def _report_churned(self, churned: list[TrainerRun], window_end: float | None) -> float:
        """Reports how the trainers fared under churn; returns their samples/s together (before `window_end`)."""
        churn_rate, overlap = concurrent_rate(churned, until=window_end)
        longest = stall(churned)
        self.report.update(
            steps=sum(run.summary["steps"] for run in churned),
            churn_seconds=round(
                max(r.start + r.summary["seconds"] for r in churned) - min(r.start for r in churned), 1
            ),
            churn_samples_per_s=round(churn_rate, 2),
            churn_window_s=round(window_end - max(r.start for r in churned), 1) if window_end else None,
            trainers_overlap=round(overlap, 3),
            samples_per_s_per_10s=samples_over_time(churned),
            longest_stall_s=round(longest, 2),
            stall_over_30s=longest > STALL_BOUND,
            loss_first_last=[[round(r.summary["first_loss"], 3), round(r.summary["last_loss"], 3)] for r in churned],
            **{
                name: sum(run.summary.get(name, 0) for run in churned)
                for name in ("retries", "bans", "backwards_moved", "samples_resent", "requeued")
            },
        )
        return churn_rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`argv`, or this process's), checked: a wrong combination ends with a usage error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs back to back, each a fresh swarm")
    parser.add_argument("--trainers", type=int, default=1, help="trainers at once, each on its own data shard")
    parser.add_argument("--peers-per-stage", type=int, default=2, help="peers per stage at the start")
    parser.add_argument(
        "--baseline-steps",
        type=int,
        default=60,
        help="steps per trainer with no churn, before and after (20 steps, about 9 s, gave baselines 5-36%% apart "
        "before and after one run's churn on a 2-core host: the fraction moved with them)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=25,
        help="steps per trainer before the first baseline, not measured: the swarm takes its standby copies (each "
        "first taken once its stage is --standby-every steps in), so that the baseline trains the swarm that the "
        "churn trains, copies and all; as many again before the baseline after the churn where peers were started "
        "to restore the first one's layout; 0: none",
    )
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of churn (kill and wave modes)")
    parser.add_argument("--kill-every", type=float, default=8.0, help="mean seconds between kills (kill mode)")
    parser.add_argument("--signal", choices=["kill", "term"], default="kill", help="how peers are taken down")
    parser.add_argument("--trace", help="replay this spot trace instead of random kills")
    parser.add_argument(
        "--wave",
        type=float,
        metavar="SHARE",
        help="wave mode instead of random kills: every --wave-every seconds, kill this share (in (0, 1]) of the live "
        "peers at once, then refill",
    )
    parser.add_argument("--wave-every", type=float, default=30.0, help="seconds between waves (wave mode)")
    parser.add_argument(
        "--refill-after",
        type=float,
        default=5.0,
        help="seconds after a wave before its replacements start, each on the stage with the fewest peers (wave mode)",
    )
    parser.add_argument("--trace-minutes", type=float, default=10.0, help="compress the trace into this long")
    parser.add_argument("--max-peers", type=int, default=6, help="live peers at the trace's peak (scaled)")
    parser.add_argument("--phase-timeout", type=float, default=900.0, help="seconds one phase's trainers may take")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices")
    parser.add_argument(
        "--spare-last-peer",
        choices=["yes", "no"],
        default="no",
        help="yes: never kill a stage's last serving peer; no: kill as the trace or the dice say (stages die and "
        "come back from standby copies)",
    )
    parser.add_argument(
        "--preload",
        choices=["yes", "no"],
        default="yes",
        help="yes: peers are forked from a process that imported torch and hivemind once, as the demo's are, so "
        "that a start does not spend the CPU the other peers train on (on a real swarm each peer pays its own); "
        "no: each peer is launched as its own program",
    )
    parser.add_argument(
        "--trust-root",
        choices=["yes", "no"],
        default="no",
        help="yes: each run's swarm has a trust root and its trainers a voucher, so receipts count and spot checks "
        "run; the report counts the checks and every peer accused (an honest run accuses none)",
    )
    parser.add_argument(
        "--spot-check-share", type=float, help="with --trust-root yes: the share of forwards checked (trainer default)"
    )
    args = parser.parse_args(argv)
    if args.warmup_steps < 0 or args.baseline_steps < 1:
        parser.error("--warmup-steps must be 0 or more and --baseline-steps 1 or more")
    if not 1 <= args.trainers <= len(SHARDS) or args.runs < 1:
        parser.error(f"--runs must be 1 or more and --trainers within 1..{len(SHARDS)} (one data shard each)")
    if args.wave is not None:
        if not 0 < args.wave <= 1:
            parser.error(f"--wave takes the share of live peers each wave kills, in (0, 1]; got {args.wave}")
        if args.trace:
            parser.error("--wave and --trace are two kinds of churn: give one")
        if args.wave_every <= 0 or args.refill_after < 0:
            parser.error("--wave-every must be above 0 seconds and --refill-after 0 or more")
    return args


def mode(args: argparse.Namespace) -> str:
    """The kind of churn, as the report names it."""
    if args.trace:
        return f"trace {args.trace} in {args.trace_minutes} min"
    if args.wave:
        return f"waves of {args.wave:g} of the peers every {args.wave_every}s, refilled after {args.refill_after}s"
    return f"kill every {args.kill_every}s"


def main() -> None:
    args = parse_args()
    # a caller's timeout (or Ctrl-C) still stops every process this run started, on the way out of LocalSwarm
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    workdir = Path(tempfile.mkdtemp(prefix="chaos-"))
    runs: list[dict[str, Any]] = []
    interrupted = False
    try:
        for index in range(args.runs):
            runs.append({"run": index})
            try:
                one_run(args, index, workdir / f"run{index}", runs[-1])
            except RunFailed as e:
                runs[-1]["error"] = str(e)  # the next run is a fresh swarm: go on, and count this one failed
            print(f"run {index}: {json.dumps(runs[-1])}", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
        if runs:
            runs[-1].setdefault("error", "interrupted")
    result = {
        "mode": mode(args),
        "signal": args.signal,
        "preloaded": args.preload == "yes",
        "trainers": args.trainers,
        "ledger": supports_ledger(),
        "workdir": str(workdir),
        "interrupted": interrupted,
        "total": totals(runs),
        "per_run": runs,
    }
    print(json.dumps(result))
    sys.exit(130 if interrupted else 1 if result["total"]["runs_failed"] else 0)


if __name__ == "__main__":
    main()
