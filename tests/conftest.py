"""Shared fixtures: real local swarms of processes, and a guard that none outlives its test."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import re
import signal
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from swarm.launch.local_swarm import LocalSwarm

# Each test process computes on one thread, as every peer process does: the suite's two workers and the
# swarms they start share two cores, where more threads only spin against each other (a one-process
# reference run took minutes instead of seconds on a loaded machine).
torch.set_num_threads(1)

# A small, fixed corpus present on every machine: the Python source of argparse.
SMALL_CORPUS = str(Path(__import__("argparse").__file__))


# Every process a test starts inherits this tag, however deep: a peer whose parent was killed is
# re-parented to init, but its environment still says which test session started it.
SESSION_TAG = f"PYTEST_SWARM_SESSION={uuid.uuid4().hex}"
os.environ["PYTEST_SWARM_SESSION"] = SESSION_TAG.split("=", 1)[1]


def pytest_collection_modifyitems(config, items):
    """Files whose tests declare the longest time limits run first (a file's order within stays): with the
    suite split by file over two workers (pyproject's addopts), both then finish together, instead of one
    waiting out a long swarm test at the end."""
    cost: collections.Counter = collections.Counter()
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            cost[item.path] += float(marker.args[0])
    first_seen = {path: index for index, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-cost[item.path], first_seen[item.path]))


def _tagged_processes() -> dict[int, str]:
    """Processes started by this test session, other than pytest itself: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if SESSION_TAG.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture(autouse=True, scope="session")
def no_leftover_processes():
    """Kills whatever this session's tests left running (other sessions' are left alone); fails on p2pd."""
    yield
    # torch's shared-memory manager (started by hivemind's futures where HIVEMIND_MEMORY_SHARING_STRATEGY asks for
    # file_system) is left alone: it exits once this process lets go of its shared memory, and killed first it
    # aborts this process at exit
    left = {pid: cmd for pid, cmd in _tagged_processes().items() if "torch_shm_manager" not in cmd}
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    daemons = [pid for pid, cmd in left.items() if "hivemind_cli/p2pd" in cmd]
    if daemons:
        pytest.fail(f"tests left {len(daemons)} p2pd processes running", pytrace=False)


def run_p2p_client(initial_peers: list[str], coroutine_fn):
    """Runs `coroutine_fn(p2p)` with a fresh libp2p client joined to `initial_peers`, then shuts it down."""
    import asyncio

    from hivemind.p2p import P2P

    async def main():
        p2p = await P2P.create(initial_peers=initial_peers)
        try:
            # the daemon finds peers by id through the peers it is connected to: until its bootstrap connection
            # is up, a dial by id fails with "failed to find any peer in table"
            deadline = asyncio.get_running_loop().time() + 30
            while not await p2p.list_peers() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            return await coroutine_fn(p2p)
        finally:
            await p2p.shutdown()

    return asyncio.run(main())


def run_as_stage_members(initial_peers: list[str], stage: int, count: int, coroutine_fn, ttl: float = 300.0):
    """Runs `coroutine_fn(*p2ps)` with `count` libp2p clients that each hold a signed record as a joining
    peer of `stage` (of gpt-tiny in 3 stages): peers of that stage take them for stage-mates."""
    import asyncio

    from swarm.net.dht_node import TetheredDHT
    from swarm.proto import PROTOCOL_VERSION
    from swarm.records.stage_records import JOINING, StageRecord, announce

    dhts = []
    try:
        for _ in range(count):
            dhts.append(TetheredDHT(initial_peers=initial_peers, start=True))
            peer_id = str(dhts[-1].peer_id)
            record = StageRecord(peer_id, stage, "gpt-tiny", 3, JOINING, 0, 0.0, 0, 1, 0, PROTOCOL_VERSION)
            assert announce(dhts[-1], "swarm", record, ttl)

        async def main():
            return await coroutine_fn(*[await dht.replicate_p2p() for dht in dhts])

        return asyncio.run(main())
    finally:
        for dht in dhts:
            dht.shutdown()


def wait_for_records(initial_peers: list[str], ready, timeout: float = 90.0, num_stages: int = 3) -> dict:
    """Polls the DHT until `ready(records)` holds; returns the records (AssertionError on timeout)."""
    from swarm.net.dht_node import TetheredDHT
    from swarm.records.stage_records import fetch_stage_records

    dht = TetheredDHT(initial_peers=initial_peers, start=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            records = fetch_stage_records(dht, "swarm", num_stages)
            if ready(records):
                return records
            assert time.monotonic() < deadline, f"the swarm did not get ready: {records}"
            time.sleep(0.3)
    finally:
        dht.shutdown()


METRICS_LINE = re.compile(r"Metrics on (http://127\.0\.0\.1:\d+/metrics)")


def metrics_url(local_swarm, name: str, timeout: float = 60.0) -> str:
    """The endpoint process `name`, started with --metrics-port 0, logged it serves on."""
    process, log = local_swarm.processes[name], local_swarm.log_path(name)
    deadline = time.monotonic() + timeout
    while not (found := METRICS_LINE.search(log.read_text(errors="replace") if log.exists() else "")):
        assert process.poll() is None, f"{name} exited:\n{log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"{name} logged no metrics address:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return found.group(1)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a process's samples of `name` with these labels, read from its metrics endpoint."""
    return metric_sum(metric_samples(url), name, **labels)


def metric_samples(url: str) -> list:
    """Every sample a process's metrics endpoint shows now (one read, for several figures of one moment)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metric_sum(samples: list, name: str, **labels: str) -> float:
    """The sum of `samples` named `name` with these labels."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


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


# --- a small training run shared by the fidelity tests ----------------------------------------------


def model_flags(model: str = "gpt-tiny") -> list[str]:
    return ["--model", model, "--num-stages", "3", "--seed", "7"]


TARGET, MICRO, LR = 24, 5, 3e-3


def peer_flags(checkpoint_dir: Path, *extra: str, model: str = "gpt-tiny") -> list[str]:
    """Flags of a peer in the fidelity tests: the reference's model, batch and optimizer."""
    return [
        *model_flags(model),
        "--target-batch-size",
        str(TARGET),
        "--lr",
        str(LR),
        "--checkpoint-dir",
        str(checkpoint_dir),
        "--announce-period",
        "0.5",
        *extra,
    ]


def trainer_flags(
    steps: int, summary_file: Path, microbatch_size: int = MICRO, in_flight: int | None = 3, model: str = "gpt-tiny"
) -> list[str]:
    """Flags of a trainer in the fidelity tests, training `steps` steps on SMALL_CORPUS; `in_flight` None: the
    window follows the links (the default) instead of a fixed --max-in-flight."""
    return [
        *model_flags(model),
        "--steps",
        str(steps),
        "--microbatch-size",
        str(microbatch_size),
        *(["--max-in-flight", str(in_flight)] if in_flight is not None else []),
        "--data",
        SMALL_CORPUS,
        "--summary-file",
        str(summary_file),
        "--no-progress",
        "--compression",
        "none",  # exact: the reference comparison allows only rounding
    ]


@functools.cache
def reference_run(
    steps: int,
    microbatch_size: int = MICRO,
    model: str = "gpt-tiny",
    stage_blocks: tuple[int, ...] = (),
    num_stages: int = 3,
):
    """The same training in one process (see swarm.trainer.reference). Deterministic, so each is run once per
    test process and shared: callers only read it."""
    from swarm.models import get_model_spec
    from swarm.models.optimizer import OptimizerSettings
    from swarm.trainer.data import ByteCorpus
    from swarm.trainer.reference import train_reference

    return train_reference(
        get_model_spec(model, **({"stage_blocks": stage_blocks} if stage_blocks else {})),
        num_stages,
        ByteCorpus(SMALL_CORPUS),
        steps,
        TARGET,
        microbatch_size,
        OptimizerSettings(lr=LR),
        seed=7,
    )


def parameter_differences(module, parameters: dict) -> tuple[float, float]:
    """The largest and the mean absolute difference between a module's parameters and a state dict."""
    import torch

    diffs = torch.cat([(t.detach() - parameters[name]).abs().flatten() for name, t in module.state_dict().items()])
    return float(diffs.max()), float(diffs.mean())


def reordering_noise(
    steps: int, stage: int, microbatch_size: int = MICRO, model: str = "gpt-tiny"
) -> tuple[float, float]:
    """How far the one-process reference moves when only its summation order changes (other microbatches).

    Training amplifies rounding differences step after step (Adam rescales tiny gradients to lr-sized
    updates), so over many steps two exact runs drift apart; this measures that drift.
    """
    reordered = reference_run(steps, microbatch_size=3, model=model).stages[stage]
    return parameter_differences(reordered, reference_run(steps, microbatch_size, model).stages[stage].state_dict())


DRIFT_FLOOR = 1e-5  # mean parameter difference; one lost 5-sample microbatch moves it by about 1.4e-4


def assert_matches_reference(module, parameters: dict, what: str, noise: tuple[float, float] = (0.0, 0.0)) -> None:
    """A swarm's parameters equal the one-process reference's up to floating-point reordering.

    Tolerance: attention key biases have an exactly-zero true gradient, so their gradient is pure
    rounding noise that Adam scales up to lr-sized steps; elsewhere the swarm agrees to ~1e-6.
    A lost or doubled microbatch moves parameters by ~lr (3e-3), far above this.

    Longer runs pass the `noise` of a reordered reference (see reordering_noise). Drift from rounding
    grows chaotically, so two reorderings can end an order of magnitude apart: the swarm may drift
    20 times that far (seen: 10.7 times in the largest difference, 12 steps, a peer killed under load; 15
    times in the mean). Over many steps the mean is what tells a lost microbatch. Measured at 20 steps:
    noise (max, mean) about (4e-4, 3e-6); one lost microbatch of 5 samples moves the mean by 1.4e-4,
    still several times over the bound.
    """
    max_diff, mean_diff = parameter_differences(module, parameters)
    assert max_diff < max(1e-4, 20 * noise[0]), f"{what} differs from the one-process reference by {max_diff}"
    # a run long enough to drift may drift further than 10 reorderings' worth (seen: 15x over 16 steps, and
    # 11x with a newcomer and a mover under load); up to 20x (3e-5 at 16 steps) or DRIFT_FLOOR it is still
    # 4 times short of what one lost microbatch does
    mean_bound = max(1e-7, 20 * noise[1], DRIFT_FLOOR if noise[1] > 0 else 0.0)
    assert mean_diff < mean_bound, f"{what}: mean parameter difference {mean_diff}"
