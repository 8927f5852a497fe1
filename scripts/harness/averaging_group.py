"""A stage of N mate processes (`harness.averaging_mate`) started, driven round by round, and measured.

`run_group` starts the mates (the first, then the rest joining its DHT node), waits until all are ready,
then starts every round on all of them at one wall-clock moment and collects what each says: seconds,
bytes sent and received, the result's digest, CPU seconds; at the end, each mate's peak memory. A mate
that fails, or a group that outlives `deadline`, ends the run with an error in the figures instead.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.averaging_mate import PROTOCOL_PREFIX, bench_gradient, digest

SCRIPTS = Path(__file__).resolve().parents[1]
# what hivemind logs when a round ends inexact without failing: a part whose reducer failed keeps the mate's
# own values ("received 50.0% results"), and a step retried after a part was applied in place averages again
HIVEMIND_FALLBACKS = re.compile(r"Averaging: received [0-9.]+% results|caught .*, retrying")
START_DELAY = 1.0  # seconds between telling the mates a round's start time and that time


@dataclass
class GroupSpec:
    """What one group runs: its engine, its size, the gradient and how the mates are set up."""

    engine: str  # "swarm" or "hivemind"
    mates: int
    parameters: int
    rounds: int
    warmup: int = 1
    seed: int = 0
    env: dict[str, str] | None = None  # the mates' environment (PYTHONPATH picks the tree measured)
    extra: list[str] = field(default_factory=list)  # more flags for every mate
    deadline: float = 600.0  # seconds the whole group may take, start-up included
    log_dir: Path | None = None  # each mate's stderr goes to a file here
    label: str = ""  # names the logs (default: the engine)


class Mate:
    """One mate process and the lines it has said."""

    def __init__(
        self, rank: int, command: list[str], env: dict[str, str] | None, log: Path | None, said: queue.Queue
    ) -> None:
        self.rank = rank
        self.said = said  # (rank, line) of every mate of the group; (rank, None) when one ends
        self.stderr = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            command,
            cwd=SCRIPTS,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            start_new_session=True,  # its own process group: its DHT node and daemons are counted as its own
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith(PROTOCOL_PREFIX):
                self.said.put((self.rank, json.loads(line[len(PROTOCOL_PREFIX) :])))
        self.said.put((self.rank, None))

    def tell(self, **command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def end(self, until: float) -> None:
        """Waits until `until` for the mate to leave, then ends its whole process group (its DHT node included)."""
        try:
            self.process.wait(max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        if self.stderr is not subprocess.DEVNULL:
            self.stderr.close()


def end_all(mates: list[Mate], grace: float = 20.0) -> None:
    """Ends every mate: EOF on its stdin (a mate between rounds leaves), then its process group after `grace`."""
    for mate in mates:
        try:
            mate.process.stdin.close()
        except OSError:
            pass
    until = time.monotonic() + grace
    for mate in mates:
        mate.end(until)


def hear_all(mates: list[Mate], said: queue.Queue, key: str, until: float) -> list[dict]:
    """Each mate's next line that holds `key`, in rank order; RuntimeError as soon as one ends, or at `until`."""
    heard: dict[int, dict] = {}
    while len(heard) < len(mates):
        try:
            rank, line = said.get(timeout=max(0.1, until - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"{len(mates) - len(heard)} mate(s) said nothing in time") from None
        if line is None:
            raise RuntimeError(f"mate {rank} ended (exit code {mates[rank].process.wait()})")
        if key in line:
            heard[rank] = line
    return [heard[rank] for rank in range(len(mates))]


def _command(spec: GroupSpec, rank: int, initial_peers: list[str]) -> list[str]:
    command = [sys.executable, "-m", "harness.averaging_mate", "--engine", spec.engine, "--rank", str(rank)]
    command += ["--mates", str(spec.mates), "--parameters", str(spec.parameters), "--seed", str(spec.seed)]
    if initial_peers:
        command += ["--initial-peers", *initial_peers]
    return command + spec.extra


def expected_digest(spec: GroupSpec) -> str:
    """The digest of the exact sum of every mate's gradient."""
    total = bench_gradient(spec.seed, 0, spec.parameters)
    for rank in range(1, spec.mates):
        total += bench_gradient(spec.seed, rank, spec.parameters)
    return digest(total)


def run_group(spec: GroupSpec) -> dict:
    """Runs the group and summarizes it (see `summarize`); {"error": ...} with what was measured if it failed."""
    started = time.monotonic()
    until = started + spec.deadline
    mates: list[Mate] = []
    said: queue.Queue = queue.Queue()
    rounds: list[list[dict]] = []
    peaks: list[dict] = []
    name = spec.label or spec.engine
    log = (lambda rank: spec.log_dir / f"{name}-{spec.mates}-{rank}.log") if spec.log_dir else (lambda _: None)
    try:
        mates.append(Mate(0, _command(spec, 0, []), spec.env, log(0), said))
        initial_peers = hear_all(mates, said, "maddrs", until)[0]["maddrs"]
        for rank in range(1, spec.mates):
            mates.append(Mate(rank, _command(spec, rank, initial_peers), spec.env, log(rank), said))
        hear_all(mates, said, "ready", until)
        setup_s = time.monotonic() - started
        for index in range(spec.warmup + spec.rounds):
            at = time.time() + START_DELAY
            for mate in mates:
                mate.tell(round=index, at=at)
            rounds.append(hear_all(mates, said, "round", until))
        for mate in mates:
            mate.tell(stop=True)
        peaks = hear_all(mates, said, "peak_kib", until)
    except (RuntimeError, OSError) as e:
        return {"error": str(e), "rounds_done": len(rounds), "seconds": round(time.monotonic() - started, 1)}
    finally:
        end_all(mates)
    result = summarize(spec, rounds[spec.warmup :], peaks, setup_s, expected_digest(spec))
    fallbacks = count_fallbacks([log(mate.rank) for mate in mates]) if spec.engine == "hivemind" else 0
    if fallbacks:
        result["hivemind_fallbacks"] = fallbacks
    return result


def count_fallbacks(logs: list[Path | None]) -> int:
    """How many times hivemind said a mate's round fell back to its own values or was averaged again."""
    said = [log.read_text(errors="replace") for log in logs if log is not None and log.exists()]
    return sum(len(HIVEMIND_FALLBACKS.findall(text)) for text in said)


def summarize(spec: GroupSpec, rounds: list[list[dict]], peaks: list[dict], setup_s: float, expected: str) -> dict:
    """Per round: the slowest mate's seconds; medians over the rounds; bytes and memory per peer."""
    gradient_bytes = 4 * spec.parameters
    ok = [r for r in rounds if not any(m.get("failed") for m in r)]
    times = [max(m["seconds"] for m in r) for r in rounds]
    sent = [statistics.mean(m["sent"] for m in r) for r in rounds]
    received = [statistics.mean(m["received"] for m in r) for r in rounds]
    digests = {m["digest"] for r in rounds for m in r}
    peak = [p["peak_kib"] * 1024 for p in peaks]
    programs = sorted({program for r in rounds for m in r for program in m["cpu_s"]})
    cpu = {p: statistics.median(sum(m["cpu_s"].get(p, 0.0) for m in r) for r in rounds) for p in programs}
    result = {
        "mates": spec.mates,
        "rounds": len(rounds),
        "failed_rounds": len(rounds) - len(ok),
        "round_s": round(statistics.median(times), 4),
        "round_s_each": [round(t, 3) for t in times],
        "sent_bytes_per_peer": round(statistics.median(sent)),
        "sent_gradients_per_peer": round(statistics.median(sent) / gradient_bytes, 3),
        "sent_gradients_most": round(max(m["sent"] for r in rounds for m in r) / gradient_bytes, 3),
        "received_bytes_per_peer": round(statistics.median(received)),
        "received_gradients_per_peer": round(statistics.median(received) / gradient_bytes, 3),
        "peak_memory_mb_per_peer": round(statistics.median(peak) / 2**20, 1),
        "peak_memory_mb_most": round(max(peak) / 2**20, 1),
        "peak_memory_gradients_per_peer": round(statistics.median(peak) / gradient_bytes, 2),
        # where the time went: CPU seconds per round of all the mates' processes together, by program
        "cpu_s_per_round": {p: round(s, 3) for p, s in cpu.items()},
        "exact": digests == {expected},
        # rounds in which every mate's result was the exact sum
        "exact_rounds": sum(all(m["digest"] == expected for m in r) for r in rounds),
        "setup_s": round(setup_s, 1),
    }
    dropped = sum(m.get("dropped", 0) for r in rounds for m in r)
    if dropped:
        result["dropped_members"] = dropped
    # hivemind: from the round's start until a mate opened its first stream of parts (the group was formed);
    # a pair of mates shares one stream, so only one of the two opens it
    opened = [[m["matchmaking_s"] for m in r if "matchmaking_s" in m] for r in ok]
    if any(opened):
        result["matchmaking_s"] = round(statistics.median(min(times) for times in opened if times), 4)
    groups = sorted({m["group"] for r in rounds for m in r if "group" in m})
    if groups:
        result["group_sizes"] = groups  # hivemind: the sizes of the groups its matchmaking formed
    errors = sorted({m["error"] for r in rounds for m in r if "error" in m})
    if errors:
        result["errors"] = errors[:3]
    return result
