"""Seconds since this process was launched, from the kernel's record of its start: the start-up time
a user waits for includes the interpreter and the imports, which no clock started in Python sees."""

from __future__ import annotations

import os
import time


def seconds_since_launch() -> float:
    """Seconds since the kernel started this process (Linux); since this module was imported elsewhere."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as file:
            # the command name may hold spaces or parentheses: fields are counted after its closing one
            fields = file.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


def startup_breakdown(marks: dict[str, float]) -> str:
    """ "imports 1.06s, DHT 0.33s, ...": the seconds each start-up phase took, from milestones after launch."""
    phases, previous = [], 0.0
    for name, at in marks.items():
        phases.append(f"{name} {at - previous:.2f}s")
        previous = at
    return ", ".join(phases)


_IMPORTED = time.perf_counter()
