"""One standby copy of another stage's state, as its holder keeps it (`swarm.peer.standby`).

A copy lives in host memory or, past `--standby-memory-mb`, in a state file under `--checkpoint-dir`.
A copy in memory is kept as a live stage module and optimizer on the CPU, so that the holder can
catch it up with the stage's step deltas (`swarm.peer.step_deltas`) instead of downloading the whole
state again; one on disk is refreshed whole.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.peer.stage_state import (
    StageStateError,
    load_state_tensors,
    parameter_fingerprint,
    state_tensors,
)
from swarm.peer.state_file import StateFileError, read_tensor_list
from swarm.peer.step_deltas import StepDelta, apply_deltas


@dataclass
class Standby:
    """One stage's state as a holder keeps it: live on the CPU (`module`), as `tensors`, or on disk (`path`)."""

    stage: int
    step: int
    samples_stepped: int
    has_optimizer_state: bool
    fingerprint: str  # of the parameters, as replicas announce it
    nbytes: int
    tensors: list[torch.Tensor] | None = None
    path: Path | None = None
    module: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    # reentrant: `snapshot` reads the tensors (`load`, which takes it too) and the version they are at under one hold
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def in_memory(self) -> bool:
        return self.path is None

    def make_live(self, template: torch.nn.Module, settings: OptimizerSettings) -> None:
        """Turns `tensors` into a stage module and optimizer on the CPU (built from `template`'s shapes, on the meta
        device, with `settings`), which step deltas can advance; the tensors are dropped."""
        if self.tensors is None:
            return
        module = _empty_like(template)
        optimizer = build_optimizer(module, settings)
        load_state_tensors(module, optimizer, self.tensors, self.has_optimizer_state)
        with self.lock:
            self.module, self.optimizer, self.tensors = module, optimizer, None

    def load(self) -> list[torch.Tensor]:
        """The state's tensors (copies of a live copy's, taken under its lock; read back from disk if spilled)."""
        if self.module is not None:
            with self.lock:
                tensors, has_optimizer_state = state_tensors(self.module, self.optimizer)
                if has_optimizer_state != self.has_optimizer_state:
                    raise StageStateError(f"the standby copy of stage {self.stage} is half stepped; refresh it")
                return tensors
        if self.tensors is not None:
            return self.tensors
        try:
            return read_tensor_list(self.path)
        except StateFileError as e:
            raise StageStateError(
                f"the standby copy of stage {self.stage} cannot be used ({e}); is the disk under --checkpoint-dir "
                "full or failing?"
            ) from None

    def snapshot(self) -> tuple[list[torch.Tensor], int, str, int, bool]:
        """The state's tensors with the step, fingerprint, samples stepped and optimizer flag they are at, read
        together: a catch-up landing between the tensors and the step would give a step they are not at."""
        with self.lock:
            return self.load(), *self.version, self.samples_stepped, self.has_optimizer_state

    def apply(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Copies the state into a freshly built stage and its optimizer."""
        load_state_tensors(module, optimizer, self.load(), self.has_optimizer_state)

    def advance(self, deltas: list[StepDelta]) -> tuple[int, str]:
        """Applies the stage's `deltas` (the first at this copy's step) to a live copy; returns (step, fingerprint)."""
        with self.lock:  # checked under the lock: deltas applied twice would make a copy no peer ever held
            if self.module is None or not deltas or deltas[0].step != self.step:
                first = deltas[0].step if deltas else None
                raise StageStateError(f"deltas from step {first} do not fit stage {self.stage}'s copy at {self.step}")
            self.samples_stepped += apply_deltas(self.module, self.optimizer, deltas)
            self.has_optimizer_state |= any(d.samples > 0 for d in deltas)
            self.step, self.fingerprint = deltas[-1].step + 1, parameter_fingerprint(self.module)
            return self.step, self.fingerprint

    @property
    def version(self) -> tuple[int, str]:
        """(step, fingerprint), read together: a catch-up sets both on another thread, and a record that paired the
        new step with the old fingerprint (a p3 replay: step 170 with step 167's) announced a version that never was."""
        with self.lock:
            return self.step, self.fingerprint

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters()) if self.module is not None else 0


def _empty_like(template: torch.nn.Module) -> torch.nn.Module:
    """A CPU module with `template`'s structure whose parameters are yet to be loaded (no initialization cost)."""
    return copy.deepcopy(template).to_empty(device="cpu")
