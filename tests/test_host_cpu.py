"""The chaos report's CPU sampler: a role's CPU counts as starting in its first seconds, as running after."""

from __future__ import annotations

import subprocess
import sys
import time

from harness import host_cpu
from harness.host_cpu import HostCpu, phase_cpu

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def burn(seconds: float) -> subprocess.Popen:
    """A child (with a grandchild, as a role's DHT process is) that spends about `seconds` of CPU, then exits."""
    inner = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN.format(seconds=seconds)!r}])"
    return subprocess.Popen([sys.executable, "-c", inner])


def test_the_cpu_of_a_role_and_its_children_counts_as_starting_then_running(monkeypatch):
    monkeypatch.setattr(host_cpu, "STARTING_S", 1.0)
    with HostCpu() as cpu:
        before = cpu.snapshot()
        child = burn(3.0)
        started = time.monotonic()
        assert child.wait(60) == 0
        time.sleep(2 * host_cpu.PERIOD_S)  # the last interval is sampled
        used = phase_cpu(before, cpu.snapshot(), time.monotonic() - started, samples=10, starts=1)
    assert 2.0 < used["cpu_s"] < 4.5, used  # the burn, less what a process spent after the last sample
    assert 0.1 < used["starting_share"] < 0.6, used  # its first second of the three
    assert used["running_cpu_ms_per_sample"] > 50 and used["starting_cpu_s_per_start"] > 0, used
