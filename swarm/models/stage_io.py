"""What a stage call must carry, checked before any of it reaches the model.

A peer runs these checks on every request, so a wrong tensor count, shape, dtype or token id
comes back to the caller as a clear error instead of failing inside the model.
"""

from __future__ import annotations

import torch

from swarm.models.gpt import GPTStage


class StageInputError(ValueError):
    """The tensors of a stage call do not match what the stage takes."""


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def expected_inputs(stage: GPTStage, backward: bool) -> list[str]:
    """Names of the tensors a forward or backward call to `stage` carries, in order."""
    names = ["tokens" if stage.is_first else "hidden"]
    if backward:
        names.append("targets" if stage.is_last else "grad_outputs")
    return names


def check_stage_inputs(stage: GPTStage, backward: bool, tensors: list[torch.Tensor], max_batch: int) -> int:
    """Validates a call's tensors against `stage`; returns the batch size or raises StageInputError."""
    spec = stage.spec
    names = expected_inputs(stage, backward)
    if len(tensors) != len(names):
        kind = "backward" if backward else "forward"
        raise StageInputError(
            f"{kind} of stage {stage.stage} takes {len(names)} tensors ({', '.join(names)}), got {len(tensors)}"
        )
    first = tensors[0]
    if first.ndim < 2:
        raise StageInputError(f"{names[0]} must be [batch, seq, ...], got {_describe(first)}")
    batch, seq = first.shape[:2]
    if not 1 <= batch <= max_batch:
        raise StageInputError(f"batch size {batch} is outside 1..{max_batch} for this peer")
    if not 1 <= seq <= spec.seq_len:
        raise StageInputError(f"sequence length {seq} is outside 1..{spec.seq_len} of model {spec.name}")
    # Hidden states and their gradients are boundary tensors: bottleneck-wide when the spec has one.
    hidden_shape = (batch, seq, spec.boundary_width)
    for name, tensor in zip(names, tensors):
        if name in ("tokens", "targets"):
            if tensor.dtype != torch.int64 or tuple(tensor.shape) != (batch, seq):
                raise StageInputError(f"{name} must be int64{[batch, seq]}, got {_describe(tensor)}")
            if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= spec.vocab_size):
                raise StageInputError(f"{name} hold ids outside 0..{spec.vocab_size - 1}")
        else:
            if tensor.dtype != torch.float32 or tuple(tensor.shape) != hidden_shape:
                raise StageInputError(f"{name} must be float32{list(hidden_shape)}, got {_describe(tensor)}")
            if not bool(torch.isfinite(tensor).all()):
                raise StageInputError(f"{name} contain NaN or infinite values")
    return batch
