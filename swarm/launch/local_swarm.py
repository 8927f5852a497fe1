"""Launching a swarm of separate processes on this machine: for the demo, tests and benchmarks.

Every process runs in its own session (process group), so stopping it also stops the DHT child
and the libp2p daemons it started, and none is left behind.

With `preloaded`, peers and trainers are forked from a process that has imported torch and hivemind
once (see `swarm.launch.role_forkserver`) instead of each importing them: the demo's swarm trains sooner.
As with any use of multiprocessing, a launcher script then guards its code with
`if __name__ == "__main__":`, since the forked roles import it.

Nothing is left behind either when the launcher itself is stopped: used as a context manager, a
LocalSwarm stops its processes in order on SIGTERM or SIGINT as on an exception; and if the launcher
dies without that (SIGKILL, a second signal), each process it started leaves on its own
(see `swarm.process.lifeline`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from swarm.launch.role_forkserver import ForkedRole, start_forkserver
from swarm.process.lifeline import LAUNCHER_PID_ENV, PARENT_DEATH_SIGNAL_ENV


class LaunchError(RuntimeError):
    """A process of the local swarm failed to start."""


def _tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    # unwinds like sys.exit: `finally` blocks and `with LocalSwarm` stop what was started
    raise SystemExit(128 + signum)


class LocalSwarm:
    """A bootstrap node, peers and trainers as child processes, stopped together on exit."""

    def __init__(
        self, workdir: str | os.PathLike | None = None, env: dict[str, str] | None = None, preloaded: bool = False
    ) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="swarm-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.preloaded = preloaded
        if preloaded:  # now: it imports while the bootstrap node starts
            start_forkserver(self.env)
        self.processes: dict[str, subprocess.Popen | ForkedRole] = {}
        self.initial_peers: list[str] = []
        self._saved_handlers: dict[int, Any] = {}  # signal -> the handler to restore

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def spawn(
        self,
        name: str,
        role: str,
        flags: list[str],
        log: bool = True,
        prefix: Sequence[str] = (),
        forked: bool | None = None,
    ) -> subprocess.Popen | ForkedRole:
        """Starts `swarm ROLE FLAGS` as process `name`, its output in NAME.log (or this console).

        `prefix`: a command that runs it, e.g. `ip netns exec NAME` (it must exec the program, keeping its pid).
        `forked=False`: launched as a program even where this swarm is `preloaded` (a newcomer, as users start one).
        The process leaves, with its DHT child and daemons, when this one dies (see swarm.process.lifeline).
        """
        env = {**self.env, LAUNCHER_PID_ENV: str(os.getpid())}
        # the kernel's parent-death signal fires when the forking thread ends: only the main thread lives as long
        env[PARENT_DEATH_SIGNAL_ENV] = "1" if threading.current_thread() is threading.main_thread() else "0"
        if self.preloaded and forked is not False and not prefix and role in ("peer", "train"):
            if log:  # there as soon as this returns, as a launched process's log is
                self.log_path(name).touch()
            process = ForkedRole([role, *flags], str(self.log_path(name)) if log else None, env)
            self.processes[name] = process
            return process
        command = [*prefix, sys.executable, "-m", "swarm", role, *flags]
        output = open(self.log_path(name), "ab") if log else None
        try:
            process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT if log else None,
                env=env,
                start_new_session=True,
            )
        finally:
            if output is not None:
                output.close()
        self.processes[name] = process
        return process

    def start_bootstrap(self, flags: list[str] = (), timeout: float = 60.0) -> list[str]:
        """Starts the bootstrap DHT node (with extra `flags`) and returns the multiaddrs others join through."""
        address_file = self.workdir / "bootstrap.addr"
        address_file.unlink(missing_ok=True)
        process = self.spawn("bootstrap", "dht", ["--address-file", str(address_file), *flags])
        deadline = time.monotonic() + timeout
        while not address_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"bootstrap DHT node did not start:\n{_tail(self.log_path('bootstrap'))}")
            time.sleep(0.1)
        self.initial_peers = address_file.read_text().split()
        return self.initial_peers

    def start_peer(
        self, name: str, stage: int | str, flags: list[str] = (), forked: bool | None = None
    ) -> subprocess.Popen | ForkedRole:
        """Starts a peer for `stage` (a number or auto), joined to the bootstrap node.

        The layout asked for is kept (no rebalancing) unless `flags` set `--rebalance-period`.
        """
        pinned = [] if "--rebalance-period" in flags else ["--rebalance-period", "0"]
        peer_flags = ["--stage", str(stage), "--initial-peers", *self.initial_peers, *pinned, *flags]
        return self.spawn(name, "peer", peer_flags, forked=forked)

    def start_trainer(self, name: str, flags: list[str] = (), log: bool = True) -> subprocess.Popen | ForkedRole:
        """Starts a trainer joined to the bootstrap node."""
        return self.spawn(name, "train", ["--initial-peers", *self.initial_peers, *flags], log=log)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signals process `name`, waits up to `timeout`, then kills whatever is left of its group."""
        self.signal(name, sig)
        return self._reap(name, timeout)

    def signal(self, name: str, sig: int) -> None:
        """Sends `sig` to the main process only: it stops its own DHT child and daemons in order."""
        with contextlib.suppress(ProcessLookupError):
            self.processes[name].send_signal(sig)

    def _reap(self, name: str, timeout: float) -> int | None:
        return reap(self.processes.pop(name), timeout)

    def stop_all(self, timeout: float = 20.0) -> None:
        """Stops every process: trainers, then peers (together), then the bootstrap node."""
        waves = [
            [n for n in self.processes if n.startswith("trainer")],
            [n for n in self.processes if not n.startswith("trainer") and n != "bootstrap"],
            [n for n in self.processes if n == "bootstrap"],
        ]
        for wave in waves:
            for name in wave:
                self.signal(name, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for name in wave:
                self._reap(name, max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> LocalSwarm:
        """Makes SIGTERM exit (and an ignored SIGINT interrupt) through `with`, which stops the swarm.

        Only where the program has not handled them itself, and from the main thread (the one that
        runs Python's signal handlers).
        """
        if threading.current_thread() is threading.main_thread():
            # `timeout` and service managers send SIGTERM; a shell starts background jobs with SIGINT ignored
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._saved_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, _exit_on_signal)
            if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
                self._saved_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        return self

    def __exit__(self, *exc_info) -> None:
        # a second signal while stopping ends this process at once; its children then leave by themselves
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        self._saved_handlers.clear()
        self.stop_all()


def reap(process: subprocess.Popen | ForkedRole, timeout: float) -> int | None:
    """Waits up to `timeout` s for a process started in a session of its own, then kills what is left of its group.

    The DHT child and p2pd share the process group: whatever the main process left behind goes with it.
    """
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    return process.returncode
