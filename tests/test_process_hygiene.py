"""A launcher stopped any way at all (SIGKILL, SIGTERM, SIGINT, `timeout`) leaves no process behind.

The launcher is a small script like the benchmarks: a LocalSwarm with a bootstrap node and one
gpt-tiny peer (launched as a program, or forked from a preloaded forkserver as the demo's are), and
a DHT node of its own. Every process it starts, however deep (peers, their DHT
children, p2pd daemons), inherits an environment tag unique to the test, by which it is found in
/proc even once re-parented to init.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

TAG_NAME = "SWARM_HYGIENE_TAG"
GONE_WITHIN_S = 40.0

LAUNCHER = """
import json, sys, time
from swarm.net.dht_node import TetheredDHT
from swarm.launch.local_swarm import LocalSwarm

if __name__ == "__main__":  # forked peers re-import this script as multiprocessing's children do
    with LocalSwarm(sys.argv[1], preloaded=sys.argv[2] == "forked") as swarm:
        swarm.start_bootstrap()
        dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)  # as the benchmarks keep one
        try:
            peer = swarm.start_peer("peer0", 0, ["--model", "gpt-tiny", "--num-stages", "3"])
            while "Serving stage" not in swarm.log_path("peer0").read_text(errors="replace"):
                if peer.poll() is not None:
                    sys.exit("the peer exited")
                time.sleep(0.1)
            print(json.dumps({"peer": peer.pid, "dht": dht.pid}), flush=True)
            # not signal.pause(): a signal taken by another thread (hivemind's) would never wake it, and
            # `timeout` sends two SIGTERMs at once; the handler runs in this thread when a sleep ends
            while True:
                time.sleep(0.2)
        finally:
            dht.shutdown()
"""


# a role stuck on its way out: ignores SIGTERM, and has a child in its process group
STUBBORN = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
from swarm.process.lifeline import die_with_launcher
die_with_launcher(grace=1.0)
subprocess.Popen(["sleep", "600"])
print("up", flush=True)
signal.pause()
"""

# a launcher of STUBBORN as LocalSwarm starts a role: its own session, told the launcher's pid
STUBBORN_LAUNCHER = """
import os, subprocess, sys
from swarm.process.lifeline import LAUNCHER_PID_ENV, PARENT_DEATH_SIGNAL_ENV
env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid()), PARENT_DEATH_SIGNAL_ENV: "1"}
role = subprocess.Popen([sys.executable, sys.argv[1]], env=env, start_new_session=True, stdout=subprocess.PIPE)
role.stdout.readline()
print(role.pid, flush=True)
role.wait()
"""


def tagged(tag: str) -> dict[int, str]:
    """Live processes whose environment carries `tag`: pid -> command line (zombies have none)."""
    needle = f"{TAG_NAME}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return found


def process_group(pid: int) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[2])
    return None


def wait_until_gone(tag: str, which=lambda pid: True, timeout: float = GONE_WITHIN_S) -> dict[int, str]:
    """Polls until no tagged process that `which(pid)` selects is left; returns those left at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := {pid: cmd for pid, cmd in tagged(tag).items() if which(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


class Launcher:
    """The launcher script as a subprocess (under `timeout` if asked), every descendant tagged."""

    def __init__(self, tmp_path: Path, under_timeout: bool = False, peer: str = "launched") -> None:
        self.tag = uuid.uuid4().hex
        self.workdir = tmp_path / "swarm"
        script = tmp_path / "launcher.py"
        script.write_text(LAUNCHER)
        command = [sys.executable, str(script), str(self.workdir), peer]
        if under_timeout:
            command = ["timeout", "600", *command]
        # a file, not a pipe: a launcher (or its DHT child) writing more than a pipe holds would block on it
        self.stderr_path = tmp_path / "launcher.stderr"
        with self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, TAG_NAME: self.tag},
            )

    def wait_ready(self) -> dict[str, int]:
        """Blocks until the launcher says its peer serves: the pids of the peer and of its own DHT child."""
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(10)
            raise AssertionError(f"the launcher exited early:\n{self.logs()}")
        return json.loads(line)

    def logs(self) -> str:
        """The end of the launcher's stderr and of every log of its swarm."""
        logs = [self.stderr_path, *sorted(self.workdir.glob("*.log"))]
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)

    def wait_gone(self) -> None:
        """Waits for the signalled launcher to exit; a failure naming what still runs, with the logs, if not."""
        try:
            self.process.wait(GONE_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still runs {GONE_WITHIN_S:.0f}s on: {tagged(self.tag)}\n{self.logs()}")

    def cleanup(self) -> None:
        """Kills, by pid, whatever this launcher left (the test has failed by then)."""
        with contextlib.suppress(OSError):
            self.process.kill()
        for pid in tagged(self.tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("how", "peer"),
    [(how, "launched") for how in ("SIGKILL", "SIGTERM", "SIGINT", "timeout")]
    + [("SIGKILL", "forked"), ("SIGTERM", "forked")],
)
def test_a_stopped_launcher_leaves_no_process(tmp_path, how, peer):
    launcher = Launcher(tmp_path, under_timeout=how == "timeout", peer=peer)
    try:
        launcher.wait_ready()
        started = tagged(launcher.tag)
        daemons = [pid for pid, cmd in started.items() if "hivemind_cli/p2pd" in cmd]
        # the bootstrap's, the launcher's own DHT node's and the peer's
        assert len(daemons) >= 3, f"expected three p2pd daemons: {started}"
        # `timeout` forwards a SIGTERM it gets as it sends one on expiry: to the command and its process group
        sig = signal.SIGTERM if how == "timeout" else signal.Signals[how]
        launcher.process.send_signal(sig)
        launcher.wait_gone()
        left = wait_until_gone(launcher.tag)
        assert not left, f"left behind after {how}: {left}\n{launcher.logs()}"
        # the peer left the swarm as on SIGTERM (its own, or the one sent when its launcher died), not killed
        assert "has left" in (launcher.workdir / "peer0.log").read_text(errors="replace"), launcher.logs()
    finally:
        launcher.cleanup()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("peer", ["launched", "forked"])
def test_no_role_starts_a_shared_memory_manager(tmp_path, peer):
    """torch's `file_system` sharing would start a torch_shm_manager beside every role (see
    swarm.process.tensor_sharing): a program's start-up on the cores the swarm trains on, for nothing."""
    launcher = Launcher(tmp_path, peer=peer)
    try:
        launcher.wait_ready()
        started = tagged(launcher.tag)
        assert [pid for pid, cmd in started.items() if "hivemind_cli/p2pd" in cmd], f"no swarm came up: {started}"
        managers = {pid: cmd for pid, cmd in started.items() if "torch_shm_manager" in cmd}
        assert not managers, f"shared-memory managers started: {managers}"
        launcher.process.send_signal(signal.SIGTERM)
        launcher.wait_gone()
    finally:
        launcher.cleanup()


@pytest.mark.timeout(150)
def test_a_peer_killed_alone_takes_its_dht_node_and_daemon(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        pids = launcher.wait_ready()
        peer = pids["peer"]
        group = [pid for pid in tagged(launcher.tag) if process_group(pid) == peer]
        assert len(group) >= 3, f"the peer, its DHT child and its p2pd: {group}"
        os.kill(peer, signal.SIGKILL)  # nobody kills the rest of its group
        left = wait_until_gone(launcher.tag, lambda pid: pid in group, timeout=20)
        assert not left, f"the DHT child or p2pd of a killed peer is still running: {left}"
        launcher.process.send_signal(signal.SIGTERM)
        launcher.wait_gone()
        assert not wait_until_gone(launcher.tag)
    finally:
        launcher.cleanup()


@pytest.mark.timeout(60)
def test_a_role_that_will_not_leave_is_killed_with_its_group(tmp_path):
    tag = uuid.uuid4().hex
    (tmp_path / "role.py").write_text(STUBBORN)
    (tmp_path / "launcher.py").write_text(STUBBORN_LAUNCHER)
    launcher = subprocess.Popen(
        [sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "role.py")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, TAG_NAME: tag},
    )
    try:
        role = int(launcher.stdout.readline())
        # a child that has just exec'd shows an empty environment for a moment: poll until it carries the tag
        deadline = time.monotonic() + 10
        while len(group := [pid for pid in tagged(tag) if process_group(pid) == role]) < 2:
            assert time.monotonic() < deadline, f"the role and its child: {tagged(tag)}"
            time.sleep(0.05)
        assert len(group) == 2, f"the role and its child: {tagged(tag)}"
        launcher.kill()
        launcher.wait(10)
        # SIGTERM is ignored: only the kill of its group, after the 1 s grace, ends it
        assert not wait_until_gone(tag, timeout=15), "a role that ignored SIGTERM outlived its launcher"
    finally:
        launcher.kill()
        for pid in tagged(tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(10)
