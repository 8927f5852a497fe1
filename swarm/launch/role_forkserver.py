"""Roles forked from one process that has imported what they need: the demo's swarm starts seconds sooner.

A role launched as its own program (`python -m swarm peer ...`) first imports torch and hivemind:
about 1.7 s of CPU, and 4 s or more of waiting when the demo starts four such processes on two
cores at once. Here multiprocessing's forkserver imports them once, while the bootstrap node starts,
and each role is forked from it with nothing left to import. That includes what torch loads lazily at a
role's first backward and first optimizer step (another CPU-second per role): a peer forked into a churning
swarm on a shared host serves 2 s sooner (6.9 s to 4.6 s on two busy cores) and takes 20% less of the
CPU its mates train on.

A forked role is what a launched one is: a session of its own (stopping it stops its DHT child and
daemons), its output in its log, the environment it was given, the same exit codes; it runs its
command line as the `swarm` command does (`swarm.launch.commands`, the roles without the demo).
It leaves when its launcher dies (see `swarm.process.lifeline`), watching the launcher rather than
its parent: the forkserver lives on as long as a role it forked.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from swarm.launch.commands import ROLES, run_command_line
from swarm.process.lifeline import PARENT_DEATH_SIGNAL_ENV

_PR_SET_NAME = 15
# what `swarm peer` and `swarm train` import, and what torch imports at a role's first steps: its first backward
# loads symbolic shapes (sympy), its optimizer's first step the compiler (1 CPU-s together, in every role)
PRELOADED = [
    "swarm.peer.server",
    "swarm.trainer.trainer",
    "torch.fx.experimental.symbolic_shapes",
    "torch._dynamo",
]
_CONTEXT = multiprocessing.get_context("forkserver")


def start_forkserver(env: dict[str, str]) -> None:
    """Starts the forkserver, which imports PRELOADED in the background, with `env` as its environment
    (torch reads some of it, such as OMP_NUM_THREADS, when imported). Returns at once."""
    _CONTEXT.set_forkserver_preload(PRELOADED)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


class ForkedRole:
    """A role forked from the forkserver, with what LocalSwarm uses of a subprocess.Popen."""

    def __init__(self, argv: Sequence[str], log_path: str | None, env: dict[str, str]) -> None:
        self.args = ["swarm", *argv]
        self._process = _CONTEXT.Process(target=_run_role, args=(list(argv), log_path, env), name=argv[0])
        self._process.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: nothing to a process already reaped (its pid may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_role(argv: list[str], log_path: str | None, env: dict[str, str]) -> None:
    """In the forked process: becomes what `python -m swarm ARGV` launched by LocalSwarm would be."""
    os.setsid()
    own_hivemind_locks()
    os.environ.clear()
    os.environ.update(env)
    # the forkserver, this process's parent, lives as long as any role it forked: the role watches the launcher
    os.environ[PARENT_DEATH_SIGNAL_ENV] = "0"
    if log_path is not None:
        output = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(output, sys.stdout.fileno())
        os.dup2(output, sys.stderr.fileno())
        os.close(output)
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)  # as PYTHONUNBUFFERED gives a launched role
    sys.argv = ["swarm", *argv]
    _name_process(f"swarm {argv[0]}")
    sys.exit(run_command_line(argv, ROLES))


def own_hivemind_locks() -> None:
    """Gives this forked process hivemind's process-wide locks of its own, before it makes any DHT call.

    hivemind makes them at import, as multiprocessing locks, which a fork shares: every role forked from the
    forkserver held the very locks the forkserver imported. A role killed inside one (a DHT call creating its
    future, say) left it held for good, and every other role blocked at its next DHT call, or at its start:
    a wave run's trainers and peers all stood still for 14 minutes. A role launched as a program has its own.
    """
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()  # its future and pipe locks, and the shared-buffer lock: new, and this process's
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _name_process(name: str) -> None:
    """Names this process as `ps -o comm`, top and pgrep show it: its command line is the forkserver's."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the name stays python's
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
