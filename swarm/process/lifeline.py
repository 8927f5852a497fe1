"""Processes that die with the process that started them, so a killed launcher leaves nothing behind.

Two links of the chain live here:
- a role started by `LocalSwarm` (`swarm peer`, `swarm train`, ...) learns its launcher's pid from
  the environment and leaves as on SIGTERM when the launcher dies, then kills its own process group
  if leaving takes too long (`die_with_launcher`, called first thing by the CLI);
- a DHT node's child process ends when the process that started it dies (see `swarm.net.dht_node`).
  Its libp2p daemon needs nothing more: p2pd writes to a pipe read only by the DHT child, and dies
  of SIGPIPE within milliseconds of that child's death (measured with hivemind 1.1.12).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

# set by LocalSwarm in each child's environment; read (and removed) by the child's CLI entry point
LAUNCHER_PID_ENV = "SWARM_LAUNCHER_PID"
# set as well when the launcher started the child from its main thread: the kernel's parent-death
# signal fires when the *thread* that forked the child ends, so it is only safe from the main thread
PARENT_DEATH_SIGNAL_ENV = "SWARM_PARENT_DEATH_SIGNAL"

# how long a role may take to leave gracefully after its launcher died before its group is killed;
# the same as LocalSwarm gives a process it stops
LEAVE_GRACE_S = 20.0
POLL_S = 0.25
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Asks the kernel to send `sig` to this process when its parent dies; False where unsupported.

    The setting survives exec but not fork, and refers to the thread that forked this process.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None], name: str = "parent-watch") -> threading.Thread:
    """Calls `on_orphaned()` on a daemon thread once this process's parent is no longer `parent_pid`.

    Polls getppid: an orphan is re-parented (to init or a subreaper), whichever thread started it.
    The thread holds no lock while it waits, so the process may still fork (hivemind's DHT does).
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        on_orphaned()

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def watch_process(pid: int, on_gone: Callable[[], None], name: str = "process-watch") -> threading.Thread:
    """Calls `on_gone()` on a daemon thread once process `pid` (not this one's parent) has ended.

    A zombie counts as ended, and so does another process that took over the pid (by its start time)."""
    started = _start_time(pid)

    def watch() -> None:
        while started is not None and _start_time(pid) == started:
            time.sleep(POLL_S)
        on_gone()

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def _start_time(pid: int) -> int | None:
    """When a live process started, in clock ticks since boot; None for a process gone or a zombie."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    return None


def child_pids(pid: int | None = None) -> list[int]:
    """The pids of the live children of process `pid` (this one by default), read from /proc."""
    parent = os.getpid() if pid is None else pid
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            # the command name in parentheses may hold spaces: the fields after the last ')' are fixed
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == parent and state != "Z":
                children.append(int(entry.name))
    return children


def die_with_launcher(grace: float = LEAVE_GRACE_S) -> None:
    """In a process started by LocalSwarm: leave when the launcher dies, and be gone `grace` s later.

    Leaving is what SIGTERM does (a peer leaves its stage, shuts down its DHT node and daemons).
    If that has not ended the process `grace` seconds later, its process group is killed: LocalSwarm
    starts each process in a session of its own, holding its DHT child and p2pd. A no-op for a
    process not started by LocalSwarm.
    """
    value = os.environ.pop(LAUNCHER_PID_ENV, None)  # not inherited further: grandchildren have other parents
    use_signal = os.environ.pop(PARENT_DEATH_SIGNAL_ENV, None) == "1"
    if not value:
        return
    launcher = int(value)
    # immediate where available; the watch below covers the rest
    signalled = use_signal and set_parent_death_signal(signal.SIGTERM)
    # not the parent: gone before the kernel was asked, or a forkserver's role (swarm.launch.role_forkserver), whose
    # parent outlives the launcher while it holds roles; either way no signal comes, and the launcher is watched
    launcher_is_parent = os.getppid() == launcher
    signalled = signalled and launcher_is_parent

    def on_orphaned() -> None:
        logger.warning("The launcher of this process has gone; leaving")
        if not signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        logger.error(f"Still running {grace:.0f}s after the launcher died; killing this process and its children")
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    if launcher_is_parent:
        watch_parent(launcher, on_orphaned, name="launcher-watch")
    else:
        watch_process(launcher, on_orphaned, name="launcher-watch")
