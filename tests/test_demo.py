"""`swarm demo`, the main job: trains, summarises, exits 0, and leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SESSION_TAG, SMALL_CORPUS

# the demo forks its peers and trainer from a forkserver: they show the forkserver's command line
SWARM_PATTERN = "-m swarm |hivemind_cli/p2pd|multiprocessing.forkserver"


def swarm_processes() -> set[int]:
    """This test session's swarm processes: other sessions on the machine start swarms of their own meanwhile."""
    return {pid for pid in swarm_like_processes() if started_by_this_session(pid)}


def swarm_like_processes() -> set[int]:
    """Every process on the machine whose command line looks like a swarm's, whichever session started it."""
    out = subprocess.run(["pgrep", "-f", "--", SWARM_PATTERN], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def started_by_this_session(pid: int) -> bool:
    # every process this session starts inherits its tag (see conftest), however deep
    with contextlib.suppress(OSError):
        return SESSION_TAG.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return False


def wait_gone(pids: set[int], timeout: float = 30) -> set[int]:
    deadline = time.monotonic() + timeout
    while (alive := pids & swarm_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.mark.timeout(240)
def test_demo_trains_and_exits_cleanly(tmp_path):
    before = swarm_processes()
    summary_file = tmp_path / "summary.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm",
            "demo",
            "--steps",
            "12",
            "--data",
            SMALL_CORPUS,
            "--log-dir",
            str(tmp_path / "logs"),
            "--summary-file",
            str(summary_file),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Demo summary" in result.stdout and "first loss" in result.stdout
    plot = tmp_path / "logs" / "loss.png"  # drawn by default into the log dir, and named in the summary
    assert f"loss plot:    {plot}" in result.stdout
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and plot.stat().st_size > 10_000
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 12
    assert summary["last_loss"] < summary["first_loss"] - 0.5
    assert not wait_gone(swarm_processes() - before, timeout=5), "the demo left processes behind"


@pytest.mark.timeout(240)
def test_demo_ctrl_c_stops_everything(tmp_path):
    before = swarm_processes()
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarm",
            "demo",
            "--steps",
            "100000",
            "--data",
            SMALL_CORPUS,
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 150
        # the peers announce themselves and the trainer starts stepping
        while not any("reached step 10" in p.read_text() for p in (tmp_path / "logs").glob("peer*.log")):
            assert demo.poll() is None and time.monotonic() < deadline, "the demo did not start training"
            time.sleep(0.5)
        started = swarm_processes() - before
        # bootstrap, 3 peers, trainer (and their daemons); a failure says what the lookup saw
        looks_like = swarm_like_processes()
        assert len(started) >= 5, (
            f"found {sorted(started)} of this session's; {len(looks_like)} swarm-like processes on the machine, "
            f"{sum(started_by_this_session(p) for p in looks_like)} tagged {SESSION_TAG}; the demo is {demo.pid}"
        )
        demo.send_signal(signal.SIGINT)
        output, _ = demo.communicate(timeout=90)
    finally:
        if demo.poll() is None:  # the test failed early: still stop the demo the way a user would
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(60)
            except subprocess.TimeoutExpired:
                # the demo could not stop its swarm: kill it and what it started (their own sessions)
                for pid in {demo.pid} | (swarm_processes() - before):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    assert demo.returncode != 0 or "Demo summary" in output
    assert "Shutting the swarm down" in output
    assert not wait_gone(started), "processes survived Ctrl-C"
