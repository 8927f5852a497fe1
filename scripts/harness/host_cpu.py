"""Where a local swarm's CPU goes while it churns: the roles' first seconds of life against the rest.

On one machine every replacement peer starts on the cores the training runs on (its DHT node, its libp2p
daemons, its joining and its first standby copies), where on spot instances each brings its own. A
`HostCpu` sampler reads `/proc` every half second and charges each descendant process's CPU time to the
role it belongs to (the ancestor just below the launcher: the forkserver's or this process's child): to
"trainers" for the roles named as trainers, else as "starting" while the role is younger than
`STARTING_S` seconds, else "running". The running roles' CPU is also split by program: the role's own
process, its Python children (the DHT node) and its libp2p daemons, to say which part a phase's extra CPU
per sample is in.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

STARTING_S = 8.0  # a role's first seconds: start-up, joining, its first copies
PERIOD_S = 0.5
TICKS = os.sysconf("SC_CLK_TCK")


PROGRAMS = ("role", "children", "p2pd")  # a running role's own process, its Python children, its libp2p daemons


def _stat(pid: int) -> tuple[int, float, float, str] | None:
    """(parent pid, CPU seconds, start time in seconds since boot, program name) of `pid`; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    name = text[text.index("(") + 1 : text.rindex(")")]
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, int(fields[19]) / TICKS, name


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


class HostCpu:
    """Samples the CPU of this process's descendants in the background (see the module's docstring)."""

    def __init__(self) -> None:
        self.root = os.getpid()
        self.totals = {"starting": 0.0, "running": 0.0, "trainers": 0.0, **{f"running_{p}": 0.0 for p in PROGRAMS}}
        self.trainers: set[int] = set()  # roles charged to "trainers" (they start with every phase)
        self._last: dict[int, float] = {}
        self._since = _uptime()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-cpu", daemon=True)
        self._lock = threading.Lock()
        self._launchers: dict[int, bool] = {}  # pid -> whether it is a forkserver (read once per pid)

    def __enter__(self) -> HostCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def snapshot(self) -> dict[str, float]:
        """CPU seconds so far, per kind (starting, running, trainers); subtract two snapshots for a window."""
        with self._lock:
            return dict(self.totals)

    def _loop(self) -> None:
        while not self._stop.wait(PERIOD_S):
            self._sample()

    def _sample(self) -> None:
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := _stat(int(entry))) is not None:
                stats[int(entry)] = stat
        now = _uptime()
        seen: dict[int, float] = {}
        with self._lock:
            for pid, (_, cpu, _, name) in stats.items():
                role = self._role_of(pid, stats)
                if role is None:
                    continue
                seen[pid] = cpu
                # a process born since sampling began counts from its birth; one older, from now on
                delta = cpu - self._last.get(pid, 0.0 if stats[pid][2] >= self._since else cpu)
                if role in self.trainers:
                    kind = "trainers"
                else:
                    kind = "starting" if now - stats[role][2] < STARTING_S else "running"
                self.totals[kind] += max(0.0, delta)
                if kind == "running":
                    program = "role" if pid == role else "p2pd" if "p2pd" in name else "children"
                    self.totals[f"running_{program}"] += max(0.0, delta)
            self._last = seen

    def _role_of(self, pid: int, stats: dict[int, tuple[int, float, float, str]]) -> int | None:
        """The ancestor of `pid` just below a launcher (this process or a forkserver of it); None outside."""
        chain = [pid]
        while (parent := stats.get(chain[-1], (0,))[0]) not in (0, 1) and len(chain) < 32:
            if parent == self.root:
                break
            chain.append(parent)
        else:
            return None
        top = chain[-1]  # a child of this process
        if top not in self._launchers:
            self._launchers[top] = _is_launcher(top)
        if len(chain) >= 2 and self._launchers[top]:
            return chain[-2]  # a role the forkserver forked
        return top


def _is_launcher(pid: int) -> bool:
    """Whether `pid` is a multiprocessing forkserver (its roles are its children)."""
    try:
        return b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def phase_cpu(before: dict[str, float], after: dict[str, float], seconds: float, samples: int, starts: int) -> dict:
    """A phase's CPU from two snapshots: all of it and its share of the machine's cores; the starting peers'
    share and CPU per start; the running peers' and the trainers' CPU per sample trained."""
    used = {kind: after[kind] - before.get(kind, 0.0) for kind in after}
    total = sum(used[kind] for kind in ("starting", "running", "trainers"))
    per_sample = {
        f"{kind}_cpu_ms_per_sample": round(1000 * used[kind] / samples, 2) if samples else None
        for kind in ("running", "trainers")
    }
    return {
        "seconds": round(seconds, 1),
        "cpu_s": round(total, 1),
        "share_of_cores": round(total / max(seconds * (os.cpu_count() or 1), 1e-9), 3),
        "starting_share": round(used["starting"] / total, 3) if total else 0.0,
        "starting_cpu_s_per_start": round(used["starting"] / starts, 2) if starts else None,
        **per_sample,
        "running_cpu_ms_per_sample_by_program": {
            program: round(1000 * used[f"running_{program}"] / samples, 2) if samples else None for program in PROGRAMS
        },
    }
