"""Checkpoints of one stage: parameters, optimizer state and step, written atomically.

A checkpoint is written to a temporary file, flushed to disk, then renamed over the previous
one, so a crash at any moment leaves either the old or the new checkpoint, never a broken one.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class StageCheckpoint:
    model: str
    stage: int
    num_stages: int
    step: int
    parameters: dict[str, torch.Tensor]
    optimizer: dict
    samples_stepped: int = 0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed: unreadable, of another stage, or of another model shape."""


def checkpoint_path(directory: str | os.PathLike, model: str, stage: int, num_stages: int) -> Path:
    """Where the checkpoint of one stage lives inside a checkpoint directory."""
    return Path(directory) / f"{model}-stage{stage}-of-{num_stages}.pt"


def save_checkpoint(
    directory: str | os.PathLike,
    model: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    samples_stepped: int = 0,
) -> Path:
    """Writes the stage's state atomically and returns the checkpoint's path."""
    stage, num_stages = module.stage, module.num_stages
    path = checkpoint_path(directory, model, stage, num_stages)
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(path.name + ".*.tmp"):  # from a write killed midway
        leftover.unlink(missing_ok=True)
    payload = {
        "model": model,
        "stage": stage,
        "num_stages": num_stages,
        "step": step,
        "parameters": {name: t.detach().cpu() for name, t in module.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "samples_stepped": samples_stepped,
    }
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(directory: str | os.PathLike, model: str, stage: int, num_stages: int) -> StageCheckpoint | None:
    """The stage's checkpoint in `directory`, or None if there is none; a clear error if it is unusable."""
    path = checkpoint_path(directory, model, stage, num_stages)
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        checkpoint = StageCheckpoint(**payload)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded ({e}); move it away to start fresh") from e
    if (checkpoint.model, checkpoint.stage, checkpoint.num_stages) != (model, stage, num_stages):
        raise CheckpointError(f"checkpoint {path} holds another stage or model; move it away to start fresh")
    return checkpoint


def restore(checkpoint: StageCheckpoint, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Loads a checkpoint's parameters and optimizer state into a freshly built stage."""
    try:
        module.load_state_dict(checkpoint.parameters)
        optimizer.load_state_dict(checkpoint.optimizer)
    except (RuntimeError, ValueError, KeyError) as e:
        # the same preset with other shapes, e.g. another --vocab-size: say which settings to check
        first_line = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"the checkpoint of stage {checkpoint.stage} does not fit this model ({first_line}); start the peer "
            "with the settings it was saved with (--model, --num-stages, --vocab-size), or move the checkpoint "
            "away to start fresh"
        ) from None
