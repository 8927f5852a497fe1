"""Joining the swarm's DHT: a bootstrap node slow to answer a newcomer's first pings does not turn it away."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from swarm.launch.local_swarm import LocalSwarm


def child_pids_of(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def wait_for_line(path: Path, text: str, process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in (log := path.read_text(errors="replace")):
        assert process.poll() is None, f"exited before {text!r}:\n{log[-2000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout:.0f}s:\n{log[-2000:]}"
        time.sleep(0.1)


def test_a_newcomer_whose_first_pings_go_unanswered_joins_once_the_bootstrap_node_answers(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        initial_peers = swarm.start_bootstrap()
        bootstrap = swarm.processes["bootstrap"]
        # the bootstrap's DHT node: its libp2p daemon keeps taking streams, unanswered while the node is stopped
        node = [pid for pid in child_pids_of(bootstrap.pid) if b"swarm" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(node) == 1, node
        os.kill(node[0], signal.SIGSTOP)
        try:
            newcomer = swarm.spawn("newcomer", "dht", ["--initial-peers", *initial_peers])
            wait_for_line(swarm.log_path("newcomer"), "asking again (1/", newcomer, timeout=60)
        finally:
            os.kill(node[0], signal.SIGCONT)
        wait_for_line(swarm.log_path("newcomer"), "DHT node is up", newcomer, timeout=60)
        assert "none of --initial-peers answered" not in swarm.log_path("newcomer").read_text()
