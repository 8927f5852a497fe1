"""A standby holder's held calls (`swarm.peer.death_watch`) see a peer die when it dies.

A real peer over real libp2p, killed with SIGKILL, and a watcher that sends no periodic probe at all: only the
held call can tell it the peer is gone, so the probe it then sends is the watch's doing.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest
from conftest import run_p2p_client

from swarm.net.direct_plane import DirectPlane, parse_direct_address
from swarm.net.identity import load_identity
from swarm.net.wire import HANG_UP_TIMEOUT
from swarm.peer.death_watch import DeathWatch
from swarm.peer.liveness_probes import LivenessProbes
from swarm.proto import PROTOCOL_VERSION
from swarm.records.stage_records import SERVING, StageRecord

MODEL = ["--model", "gpt-tiny", "--num-stages", "3"]


def serving(peer_id: str, stage: int) -> StageRecord:
    return StageRecord(peer_id, stage, "gpt-tiny", 3, SERVING, 0, 1.0, 0, 32, 0, PROTOCOL_VERSION)


def serving_peer_id(local_swarm, name: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not (found := re.search(r"Serving stage .* peer id (\w+)", local_swarm.log_path(name).read_text())):
        assert time.monotonic() < deadline and local_swarm.processes[name].poll() is None, f"{name} never served"
        time.sleep(0.2)
    return found.group(1)


async def until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def direct_address(local_swarm, name: str) -> tuple[str, int]:
    found = re.search(r"Direct data plane on \S+, announced as (\S+)", local_swarm.log_path(name).read_text())
    assert found, f"{name} announced no direct address"
    return parse_direct_address(found.group(1))


def run_direct_client(local_swarm, name: str, peer_id: str, coroutine_fn):
    """Runs `coroutine_fn(plane)` with a direct plane over a fresh libp2p client that knows where `name` (whose
    peer id is `peer_id`) listens directly."""

    async def on_plane(p2p) -> None:
        plane = DirectPlane(p2p, load_identity(None), shared_memory=False)
        plane.addresses[peer_id] = direct_address(local_swarm, name)
        await coroutine_fn(plane)

    run_p2p_client(local_swarm.initial_peers, on_plane)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path", ["libp2p", "direct"])
def test_a_killed_peer_is_probed_at_once_and_a_live_one_called_again(local_swarm, path):
    local_swarm.start_bootstrap()
    local_swarm.start_peer("peer0", 0, MODEL)
    peer_id = serving_peer_id(local_swarm, "peer0")

    async def watch_and_kill(p2p) -> None:
        probes = LivenessProbes(record_ttl=10.0, timeout=2.0)
        tasks = []
        watch = DeathWatch(probes, spawn=lambda coroutine: tasks.append(asyncio.ensure_future(coroutine)))
        # a stage of three serving peers outlives any one death, and a holder never watches itself
        crowded = [serving(f"Qm{i}", 1) for i in range(3)]
        watch.follow(p2p, {1: crowded, 2: [serving("me", 2)]}, [1, 2], me="me")
        assert not watch.watching and not tasks
        watch.follow(p2p, {0: [serving(peer_id, 0)], 1: crowded}, [0, 1], me="me")
        assert watch.watching == {peer_id} and len(tasks) == 1
        # a live peer hangs up HANG_UP_TIMEOUT after its answer: the watch calls again, and probes nothing
        await until(lambda: watch.calls >= 2, timeout=3 * HANG_UP_TIMEOUT)
        assert watch.early_ends == 0 and probes.probes == 0
        killed = time.monotonic()
        local_swarm.signal("peer0", signal.SIGKILL)
        await asyncio.wait_for(probes.news.wait(), timeout=HANG_UP_TIMEOUT / 2)
        seen = time.monotonic() - killed
        assert peer_id in probes.silent and watch.early_ends == 1 and probes.probes == 1
        assert seen < HANG_UP_TIMEOUT / 2, f"the death was seen {seen:.1f}s after the kill"
        if path == "direct":
            # the address it answered at refuses now: a stage of it alone counts as lost at once, no grace
            assert p2p.calls["direct"] >= 2 and probes.all_refused([serving(peer_id, 0)])
        await asyncio.wait_for(tasks[0], timeout=5)  # the watch of a peer found dead ends
        assert not watch.watching

    if path == "direct":
        run_direct_client(local_swarm, "peer0", peer_id, watch_and_kill)
    else:
        run_p2p_client(local_swarm.initial_peers, watch_and_kill)
