"""What start-up costs: the clock that counts from launch, and the second an optimizer used to spend importing
torch's compiler before a peer could serve."""

from __future__ import annotations

import subprocess
import sys
import time

from swarm.process.launch_clock import seconds_since_launch, startup_breakdown


def test_the_launch_clock_counts_from_the_process_start_including_what_ran_before_python_code():
    code = "import time; time.sleep(0.5); from swarm.process.launch_clock import seconds_since_launch as s; print(s())"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    elapsed = time.monotonic() - started
    assert 0.5 <= float(out.stdout) <= elapsed + 0.05  # the clock's ticks are 10 ms
    assert 0 < seconds_since_launch() < time.clock_gettime(time.CLOCK_BOOTTIME)


def test_the_breakdown_names_each_phase_by_its_own_seconds():
    marks = {"imports": 1.25, "DHT": 1.5, "stage built": 1.75, "joined": 2.0}
    assert startup_breakdown(marks) == "imports 1.25s, DHT 0.25s, stage built 0.25s, joined 0.25s"


def test_building_a_stage_optimizer_does_not_import_the_compiler():
    code = (
        "import sys, torch\n"
        "from swarm.models.optimizer import OptimizerSettings, apply_accumulated_step, build_optimizer\n"
        "module = torch.nn.Linear(4, 4)\n"
        "optimizer = build_optimizer(module, OptimizerSettings())\n"
        "optimizer.load_state_dict(optimizer.state_dict())\n"
        "assert 'torch._dynamo' not in sys.modules, 'building the optimizer imported torch._dynamo'\n"
        "module(torch.ones(2, 4)).sum().backward()\n"
        "apply_accumulated_step(module, optimizer, 2)\n"  # the first step still works (and imports it)
        "print(float(module.weight.sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
