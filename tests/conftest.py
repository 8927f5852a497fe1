"""Shared fixtures: real local swarms of processes, and a guard that none outlives its test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.local_swarm import LocalSwarm

# A small, fixed corpus present on every machine: the Python source of argparse.
SMALL_CORPUS = str(Path(__import__("argparse").__file__))


def _p2pd_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "hivemind_cli/p2pd"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as file:
        return int(file.read().rsplit(")", 1)[1].split()[1])


def _started_here(pid: int) -> bool:
    """Whether a process belongs to this test session: a descendant, or in a LocalSwarm's group."""
    try:
        if os.getpgid(pid) in LocalSwarm.process_groups:
            return True
        while pid > 1:
            pid = _parent(pid)
            if pid == os.getpid():
                return True
    except (OSError, ValueError, IndexError):
        pass
    return False


@pytest.fixture(autouse=True, scope="session")
def no_leftover_daemons():
    """Fails the session if its tests leave libp2p daemons running (other sessions' are left alone)."""
    before = _p2pd_pids()
    yield
    left = [pid for pid in _p2pd_pids() - before if _started_here(pid)]
    if left:
        subprocess.run(["kill", "-9", *map(str, left)], check=False)
        pytest.fail(f"tests left {len(left)} p2pd processes running", pytrace=False)


@pytest.fixture
def local_swarm(tmp_path):
    """A LocalSwarm in a temporary directory, stopped (every process) when the test ends."""
    swarm = LocalSwarm(tmp_path / "swarm")
    try:
        yield swarm
    finally:
        swarm.stop_all(timeout=20)
        if sys.exc_info()[0] is not None:
            for log in sorted(swarm.workdir.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
