"""How torch shares tensors between processes here: by file descriptor, with no helper process.

hivemind sets torch's sharing strategy at import to `file_system` unless `HIVEMIND_MEMORY_SHARING_STRATEGY`
says otherwise, and that strategy starts a `torch_shm_manager` process beside every process that shares a
tensor: every role does, through the shared bytes of hivemind's futures between it and its DHT node. The
manager is a separate program that loads torch's libraries: 0.24 CPU-s per start on the machine of
`docs/benchmarks.md`, a tenth of what a newcomer costs the cores it shares in its first seconds. The
`file_descriptor` strategy (torch's own default on Linux) shares the same memory with no such process; the
tensors swarm shares are inherited by fork (hivemind's futures) or written to its own shared-memory arenas
(`swarm.net.shared_memory`), never passed one by one through a queue, so its limit on open descriptors per
tensor in flight does not bind. A user's own setting of the variable is kept.
"""

from __future__ import annotations

import os

STRATEGY_VARIABLE = "HIVEMIND_MEMORY_SHARING_STRATEGY"
STRATEGY = "file_descriptor"


def share_tensors_by_descriptor() -> None:
    """Has hivemind, when imported after this call, share tensors by file descriptor (see the module docstring)."""
    os.environ.setdefault(STRATEGY_VARIABLE, STRATEGY)
