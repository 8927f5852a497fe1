"""A stage's parameter fingerprint after each step, hashed off the runtime thread.

Over a large stage the hash (and on a GPU the copy it reads) takes a good share of a step: hashed on a
thread of its own, it overlaps the next step's first forwards instead of holding them up. The
parameters must not change meanwhile: whatever changes them waits for it first (`settle`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from torch import nn

from swarm.peer.stage_state import parameter_fingerprint

logger = logging.getLogger(__name__)


class StepFingerprints:
    """Hashes a module's parameters after each step, one step at a time, and hands each hash on."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-fingerprint")
        self._pending: Future | None = None

    def hash(self, step: int, done: Callable[[int, str], None]) -> None:
        """Hashes the parameters at `step` in the background, then calls `done(step, fingerprint)` there."""

        def work() -> None:
            try:
                done(step, parameter_fingerprint(self.module))
            except Exception:
                logger.exception(f"The work after step {step} failed")

        try:
            self._pending = self._thread.submit(work)
        except RuntimeError:  # shut down: a step taken after the peer stopped is hashed on the spot
            work()

    def settle(self) -> None:
        """Waits for the hash under way, if any (call before changing the parameters)."""
        if self._pending is not None:
            with contextlib.suppress(Exception):  # a failure was logged where it happened
                self._pending.result()
            self._pending = None

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)
