"""The chaos report's CPU sampler: a role's CPU counts as starting in its first seconds, as running after."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from harness import host_cpu
from harness.host_cpu import HostCpu, phase_cpu

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def burn(seconds: float) -> subprocess.Popen:
    """A child (with a grandchild, as a role's DHT process is) that spends about `seconds` of CPU, then exits."""
    inner = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN.format(seconds=seconds)!r}])"
    return subprocess.Popen([sys.executable, "-c", inner])


def test_a_roles_cpu_counts_as_starting_in_its_first_seconds_then_running_and_a_trainers_apart(monkeypatch):
    monkeypatch.setattr(host_cpu, "STARTING_S", 1.0)
    with HostCpu() as cpu:
        before = cpu.snapshot()
        peer, trainer = burn(3.0), burn(1.0)
        cpu.trainers.add(trainer.pid)
        started = time.monotonic()
        assert peer.wait(60) == 0 and trainer.wait(60) == 0
        time.sleep(2 * host_cpu.PERIOD_S)  # the last interval is sampled
        after = cpu.snapshot()
    used = {kind: after[kind] - before[kind] for kind in after}
    # the burns, less what a process spent after the last sample; a busy machine slows them, never speeds them
    assert 0.0 < used["starting"] <= 1.0 + 2 * host_cpu.PERIOD_S, used  # one core at most for its first second
    assert 1.0 < used["running"] < 3.5 and 0.3 < used["trainers"] < 1.5, used
    report = phase_cpu(before, after, time.monotonic() - started, samples=10, starts=1)
    assert report["starting_cpu_s_per_start"] == pytest.approx(used["starting"], abs=0.01), report
    assert report["trainers_cpu_ms_per_sample"] == pytest.approx(100 * used["trainers"], abs=0.01), report
    # the running role's CPU by program: the burn is its child's (as a peer's DHT node is), not its own process's
    by_program = report["running_cpu_ms_per_sample_by_program"]
    assert sum(by_program.values()) == pytest.approx(report["running_cpu_ms_per_sample"], abs=0.05), report
    assert by_program["children"] > 0.9 * report["running_cpu_ms_per_sample"] and by_program["p2pd"] == 0, report
