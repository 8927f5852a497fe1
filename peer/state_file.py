"""A stage's state on disk: a safetensors file of named tensors and string metadata, written atomically.

Checkpoints and standby spills are both such files, so any tool that reads safetensors opens them
(`safetensors.safe_open`, `safetensors.numpy.load_file`), and nothing read back is ever unpickled.
A file is written to a temporary file beside it, flushed to disk, then renamed over the previous
one, so a crash at any moment leaves either the old file or the new one, never a torn one; a file
torn or damaged some other way is refused with a `StateFileError` that says what is wrong.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_KEY = "format"
FORMAT = "swarm-stage-state-1"  # in every file's metadata: what wrote it, and in which layout
WIRE_PREFIX = "wire."  # a list of tensors kept in the wire's order: `wire.0`, `wire.1`, ...


class StateFileError(ValueError):
    """A state file that cannot be read: missing, torn, damaged, or written by something else."""


def write_state_file(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Path:
    """Writes `tensors` and `metadata` to `path` atomically (and clears what a write killed midway left)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(path.name + ".*.tmp"):
        leftover.unlink(missing_ok=True)
    contiguous = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.close(fd)
        save_file(contiguous, tmp, metadata={**metadata, FORMAT_KEY: FORMAT})
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_state_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The (tensors, metadata) of a state file, on the CPU; StateFileError if it cannot be read whole."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            metadata = dict(file.metadata() or {})
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except FileNotFoundError:
        raise StateFileError(f"{path} does not exist") from None
    except Exception as e:  # safetensors says what is wrong with the header or the data
        raise StateFileError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    if metadata.get(FORMAT_KEY) != FORMAT:
        raise StateFileError(f"{path} is a safetensors file, but not a stage's state (its metadata has no {FORMAT})")
    del metadata[FORMAT_KEY]
    return tensors, metadata


def write_tensor_list(path: str | os.PathLike, tensors: list[torch.Tensor]) -> Path:
    """Writes a list of tensors in the wire's order (`wire.<index>`), e.g. a standby copy as it arrived."""
    return write_state_file(path, {f"{WIRE_PREFIX}{index}": t for index, t in enumerate(tensors)}, {})


def read_tensor_list(path: str | os.PathLike) -> list[torch.Tensor]:
    """The list `write_tensor_list` wrote, in its order; StateFileError if an entry is missing or foreign."""
    tensors, _ = read_state_file(path)
    expected = [f"{WIRE_PREFIX}{index}" for index in range(len(tensors))]
    if sorted(tensors) != sorted(expected):
        raise StateFileError(f"{path} does not hold a list of {len(tensors)} tensors named {WIRE_PREFIX}0, 1, ...")
    return [tensors[name] for name in expected]


def _fsync(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
