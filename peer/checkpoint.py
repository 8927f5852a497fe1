"""Checkpoints of one stage: parameters, optimizer state and step, as a safetensors state file.

The file (`<model>-stage<s>-of-<n>.safetensors`) holds the stage's state by name (see `stage_state`)
and, in its metadata, the model, the stage, the step, the samples stepped and the optimizer's
hyperparameters; `state_file` writes it atomically, so a crash at any moment leaves either the old
or the new checkpoint. A `.pt` checkpoint an older version wrote with torch.save is still resumed,
once: the stage's next save replaces it with the safetensors one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from swarm.peer.stage_state import PARAM, named_state, split_state_key
from swarm.peer.state_file import StateFileError, read_state_file, write_state_file

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
LEGACY_SUFFIX = ".pt"  # torch.save checkpoints of older versions
HEADER = ("stage", "num_stages", "step", "samples_stepped")  # the integers in a checkpoint's metadata


@dataclass
class StageCheckpoint:
    """A stage's checkpoint as read back: its parameters by name, and the optimizer's state_dict."""

    model: str
    stage: int
    num_stages: int
    step: int
    parameters: dict[str, torch.Tensor]
    optimizer: dict
    samples_stepped: int = 0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed: unreadable, of another stage, or of another model shape."""


def checkpoint_name(model: str, stage_blocks: tuple[int, ...] = ()) -> str:
    """The model name a stage's checkpoint is kept under: with the cut where it is uneven (`gpt-tiny@1-2-3`),
    so that a peer started with another cut never takes blocks that are not its stage's."""
    return f"{model}@{'-'.join(map(str, stage_blocks))}" if stage_blocks else model


def checkpoint_path(directory: str | os.PathLike, model: str, stage: int, num_stages: int) -> Path:
    """Where the checkpoint of one stage lives inside a checkpoint directory (a `.pt` one of an older
    version, if that is there and no safetensors one yet)."""
    path = _safetensors_path(directory, model, stage, num_stages)
    legacy = path.with_suffix(LEGACY_SUFFIX)
    return legacy if not path.exists() and legacy.exists() else path


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
    path = _safetensors_path(directory, model, stage, num_stages)
    metadata = {
        "model": model,
        **{key: str(value) for key, value in zip(HEADER, (stage, num_stages, step, samples_stepped))},
        "optimizer": json.dumps(_named_param_groups(module, optimizer)),
    }
    write_state_file(path, named_state(module, optimizer), metadata)
    legacy = path.with_suffix(LEGACY_SUFFIX)
    if legacy.exists():
        legacy.unlink()
        logger.info(f"Replaced the older checkpoint {legacy} with {path}")
    return path


def load_checkpoint(directory: str | os.PathLike, model: str, stage: int, num_stages: int) -> StageCheckpoint | None:
    """The stage's checkpoint in `directory`, or None if there is none; a clear error if it is unusable."""
    path = checkpoint_path(directory, model, stage, num_stages)
    if not path.exists():
        return None
    try:
        checkpoint = _read_legacy(path) if path.suffix == LEGACY_SUFFIX else _read(path)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded ({e}); move it away to start fresh") from None
    if (checkpoint.model, checkpoint.stage, checkpoint.num_stages) != (model, stage, num_stages):
        raise CheckpointError(f"checkpoint {path} holds another stage or model; move it away to start fresh")
    return checkpoint


def resume_stage(
    directory: str | os.PathLike, model: str, module: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, int]:
    """Loads the stage's checkpoint in `directory`, if there is one, into `module` and `optimizer`; returns its
    (step, samples stepped), (0, 0) without one."""
    checkpoint = load_checkpoint(directory, model, module.stage, module.num_stages)
    if checkpoint is None:
        return 0, 0
    restore(checkpoint, module, optimizer)
    logger.info(f"Resumed stage {module.stage} from its checkpoint at step {checkpoint.step}")
    return checkpoint.step, checkpoint.samples_stepped


def restore(checkpoint: StageCheckpoint, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Loads a checkpoint's parameters and optimizer state into a freshly built stage."""
    try:
        module.load_state_dict(checkpoint.parameters)
        optimizer.load_state_dict(checkpoint.optimizer)
        _check_optimizer_shapes(optimizer)
    except (RuntimeError, ValueError, KeyError) as e:
        # the same preset with other shapes, e.g. another --vocab-size: say which settings to check
        first_line = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"the checkpoint of stage {checkpoint.stage} does not fit this model ({first_line}); start the peer "
            "with the settings it was saved with (--model, --num-stages, --vocab-size), or move the checkpoint "
            "away to start fresh"
        ) from None


def _check_optimizer_shapes(optimizer: torch.optim.Optimizer) -> None:
    """Raises ValueError unless each parameter's optimizer state (moments, ...) has the parameter's shape:
    torch's load_state_dict does not look, and the first step would fail instead."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if key != "step" and isinstance(value, torch.Tensor) and value.shape != param.shape:
                    raise ValueError(f"optimizer state {key} is {list(value.shape)}, its parameter {list(param.shape)}")


def _safetensors_path(directory: str | os.PathLike, model: str, stage: int, num_stages: int) -> Path:
    return Path(directory) / f"{model}-stage{stage}-of-{num_stages}{SUFFIX}"


def _named_param_groups(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's hyperparameters per group, with each group's parameters by name."""
    names = {id(param): name for name, param in module.named_parameters()}
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def _read(path: Path) -> StageCheckpoint:
    """A safetensors checkpoint, its optimizer state rebuilt as the state_dict that torch's optimizers load."""
    tensors, metadata = read_state_file(path)
    missing = [key for key in ("model", *HEADER, "optimizer") if key not in metadata]
    if missing:
        raise StateFileError(f"its metadata lacks {', '.join(missing)}")
    try:
        header = {key: int(metadata[key]) for key in HEADER}
        groups = json.loads(metadata["optimizer"])
    except ValueError as e:
        raise StateFileError(f"its metadata is garbled ({e})") from None
    parameters, by_name = {}, {}
    for entry, tensor in tensors.items():
        key, name = split_state_key(entry)
        if key == PARAM:
            parameters[name] = tensor
        else:
            by_name.setdefault(name, {})[key] = tensor
    order = [name for group in groups for name in group["params"]]
    param_groups, start = [], 0
    for group in groups:  # hyperparameters as saved (JSON turned tuples such as betas into lists)
        count = len(group["params"])
        settings = {k: tuple(v) if isinstance(v, list) else v for k, v in group.items() if k != "params"}
        param_groups.append({**settings, "params": list(range(start, start + count))})
        start += count
    state = {index: by_name[name] for index, name in enumerate(order) if name in by_name}
    optimizer = {"state": state, "param_groups": param_groups}
    return StageCheckpoint(metadata["model"], parameters=parameters, optimizer=optimizer, **header)


def _read_legacy(path: Path) -> StageCheckpoint:
    """A checkpoint an older version wrote with torch.save (read with weights_only: nothing is unpickled)."""
    checkpoint = StageCheckpoint(**torch.load(path, map_location="cpu", weights_only=True))
    logger.warning(
        f"Read {path}, a checkpoint in the older torch format; the stage's next save writes it as "
        f"{path.with_suffix(SUFFIX).name} and removes this one"
    )
    return checkpoint
