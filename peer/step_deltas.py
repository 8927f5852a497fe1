"""Step deltas: the summed gradient each step applied, kept for the stage's standby holders.

A standby copy refreshed whole costs the full state (parameters and both AdamW moments) each time, so
copies are refreshed only every few steps and lag behind under churn. A step's update is determined by
its summed gradient and sample count alone, so a holder that applies the same sums, with the same
optimizer rule (`step_on_sum`, which the runtime uses too), reaches the same parameters bit for bit on
the same arithmetic: a third of the bytes per step, and copies one announce period behind. A stage's
peers keep the last `--standby-deltas` steps' sums while some peer holds a copy of the stage, and give
them over the stage-mates' state protocol (`swarm.peer.delta_transfer`). The holder confirms the
result against the fingerprints the stage's peers announce, so a source that lies is caught.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from swarm.models.optimizer import apply_accumulated_step
from swarm.peer.gradient_buffers import flat_gradient, gradients_finite, set_gradients

DELTA_INTEREST = 60.0  # seconds a stage's peers keep deltas after a holder last asked for some
# what one reply to a holder carries (`swarm.peer.delta_transfer`): as many steps as fit in this many bytes,
# at most `MAX_DELTAS_PER_CALL` and at least one. A call per catch-up for a small stage (each call costs both
# sides a connection and a handshake), and a bounded message for a large one
DELTA_CALL_BYTES = 64 * 2**20
MAX_DELTAS_PER_CALL = 16


def deltas_per_call(parameters: int) -> int:
    """The most step deltas one reply carries for a stage of `parameters` values (float32 gradient sums)."""
    return max(1, min(MAX_DELTAS_PER_CALL, DELTA_CALL_BYTES // max(1, 4 * parameters)))


# what `step_on_sum` did
EMPTY = "empty"  # no samples: the group steps on nothing
NONFINITE = "nonfinite"  # a broken contribution: every replica skips alike
STEPPED = "stepped"


def step_outcome(module: nn.Module, samples: int, flat: torch.Tensor | None = None) -> str:
    """What a step on the module's summed gradients over `samples` samples does (see `step_on_sum`); with `flat`,
    the module's gradients as one vector, checked in one pass rather than per parameter."""
    if samples <= 0:
        return EMPTY
    finite = gradients_finite(module) if flat is None else bool(torch.isfinite(flat).all())
    return STEPPED if finite else NONFINITE


def step_on_sum(module: nn.Module, optimizer: torch.optim.Optimizer, samples: int, outcome: str | None = None) -> str:
    """Steps on the module's gradients summed over `samples` samples, or skips (see `step_outcome`, unless its
    `outcome` is given); clears them. The one rule for replicas and standby holders alike, so that a copy fed a
    step's sums matches the stage."""
    outcome = outcome or step_outcome(module, samples)
    if outcome == STEPPED:
        apply_accumulated_step(module, optimizer, samples)
    else:
        module.zero_grad(set_to_none=True)
    return outcome


@dataclass(frozen=True)
class StepDelta:
    """What step `step` applied: `samples` samples (0: skipped) with their summed gradient (None if skipped)."""

    step: int
    samples: int
    grad_sum: torch.Tensor | None


class DeltaRing:
    """The last `keep` steps' deltas of this peer's stage, recorded on the runtime thread, read on the loop."""

    def __init__(self, keep: int, wanted: Callable[[], bool] = lambda: True, interest: float | None = None) -> None:
        self.keep = keep
        self.wanted = wanted  # whether any peer holds a copy of the stage now: else nothing is kept
        # with `interest`, deltas are kept only that many seconds after a holder last asked for some (or took the
        # whole state), and after the ring's start: holders catch up from any of the stage's peers, so each peer
        # keeps them before it is first asked; where every holder refreshes whole (`--standby-deltas 0` there),
        # no gradient is copied once that start is past
        self.interest = interest
        self.asked_at = time.monotonic()
        self._deltas: OrderedDict[int, StepDelta] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, step: int, module: nn.Module, outcome: str, samples: int) -> None:
        """Keeps what step `step` is about to apply (call with the summed gradients on the module)."""
        lapsed = self.interest is not None and time.monotonic() - self.asked_at > self.interest
        if lapsed or not self.wanted():
            with self._lock:
                self._deltas.clear()
            return
        delta = StepDelta(step, samples, flat_gradient(module)) if outcome == STEPPED else StepDelta(step, 0, None)
        with self._lock:
            if self._deltas and next(reversed(self._deltas)) != step - 1:
                self._deltas.clear()  # a state was loaded between: older deltas do not lead here
            self._deltas[step] = delta
            while len(self._deltas) > self.keep:
                self._deltas.popitem(last=False)

    def forget(self) -> None:
        """Drops every delta (the stage's state was replaced: they no longer lead to it)."""
        with self._lock:
            self._deltas.clear()

    def note_interest(self) -> None:
        """A holder asked for deltas, or took the whole state: the steps from now on are kept for `interest` s."""
        self.asked_at = time.monotonic()

    def since(self, step: int, parameters: int) -> list[StepDelta] | None:
        """The deltas from `step` on (at most `deltas_per_call(parameters)`, for a stage of that many values), or
        None if `step`'s is no longer (or not yet) kept."""
        self.note_interest()
        limit = deltas_per_call(parameters)
        with self._lock:
            if step not in self._deltas:
                return None
            return [self._deltas[s] for s in range(step, step + limit) if s in self._deltas]


def apply_deltas(module: nn.Module, optimizer: torch.optim.Optimizer, deltas: list[StepDelta]) -> int:
    """Applies `deltas` in order to a copy of the stage, as its replicas did; returns the samples stepped on."""
    stepped = 0
    for delta in deltas:
        if delta.grad_sum is not None:
            set_gradients(module, delta.grad_sum)
        outcome = step_outcome(module, delta.samples, delta.grad_sum)
        if step_on_sum(module, optimizer, delta.samples, outcome) == STEPPED:
            stepped += delta.samples
    return stepped
