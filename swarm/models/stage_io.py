"""What a stage call must carry and what its reply must hold, checked before either is used.

A peer runs `check_stage_inputs` on every request, so a wrong tensor count, shape, dtype, token id
or value comes back to the caller as a clear error instead of failing inside the model; a trainer
runs `check_stage_outputs` on every reply, so a peer that answers garbage is that peer's fault.

Boundary tensors are in the swarm's compute dtype (`--dtype`, `swarm.models.precision`): float32, or
bfloat16 in a swarm that computes in it. One in another dtype is refused, naming the setting.

Boundary values (hidden states and their gradients) must be finite and at most `MAX_ABS_VALUE` in
magnitude. A working model's boundary activations are layer-normed sums of a few dozen terms and its
gradients are far smaller; a value beyond the bound is a broken or hostile sender, and one batch of
such values would turn every parameter it touches into infinities.
"""

from __future__ import annotations

import math

import torch

from swarm.models.gpt import GPTStage
from swarm.models.precision import flag_value

MAX_ABS_VALUE = 1e4  # largest magnitude accepted in a boundary tensor (see the module's docstring)


class StageInputError(ValueError):
    """The tensors of a stage call do not match what the stage takes."""


class StageOutputError(ValueError):
    """A stage's reply does not hold what the call asked for."""


def _describe(tensor: torch.Tensor) -> str:
    return f"{_name(tensor.dtype)}{list(tensor.shape)}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_hint(tensor: torch.Tensor, dtype: torch.dtype) -> str:
    """Why a boundary tensor of the right shape but another float dtype is refused: the swarm's --dtype."""
    if tensor.dtype == dtype or not tensor.is_floating_point():
        return ""
    return f": this stage computes in --dtype {flag_value(dtype)}, and every peer and trainer of a swarm must agree"


def expected_inputs(stage: GPTStage, backward: bool) -> list[str]:
    """Names of the tensors a forward or backward call to `stage` carries, in order (any object with the stage's
    `is_first`, `takes_tokens` and `is_last` will do)."""
    names = ["tokens" if stage.is_first else "hidden"]
    if stage.takes_tokens:
        names.append("tokens")
    if backward:
        names.append("targets" if stage.is_last else "grad_outputs")
    return names


def check_stage_inputs(
    stage: GPTStage, backward: bool, tensors: list[torch.Tensor], max_batch: int, dtype: torch.dtype = torch.float32
) -> int:
    """Validates a call's tensors against `stage`, whose boundary tensors are in `dtype`; returns the batch size
    or raises StageInputError."""
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
            if tensor.dtype != dtype or tuple(tensor.shape) != hidden_shape:
                raise StageInputError(
                    f"{name} must be {_name(dtype)}{list(hidden_shape)}, got {_describe(tensor)}"
                    + _dtype_hint(tensor, dtype)
                )
            if problem := value_problem(tensor):
                raise StageInputError(f"{name} {problem}")
    return batch


def value_problem(tensor: torch.Tensor, max_abs: float = MAX_ABS_VALUE) -> str | None:
    """What is wrong with a boundary tensor's values (non-finite, or beyond `max_abs`), or None."""
    if not tensor.numel():
        return None
    # one pass over the tensor, allocating nothing its size (it is on every call's path): the extremes are NaN
    # or infinite if any value is
    low, high = torch.aminmax(tensor.detach())
    largest = max(-float(low), float(high)) if math.isfinite(float(low)) else float(low)
    if not math.isfinite(largest):
        return "contain NaN or infinite values"
    if largest > max_abs:
        return f"hold a value of magnitude {largest:.3g}, over the limit of {max_abs:.0e}"
    return None


def check_stage_outputs(
    stage: int,
    num_stages: int,
    boundary_width: int,
    backward: bool,
    inputs: list[torch.Tensor],
    outputs: list,
    dtype: torch.dtype | None = torch.float32,
) -> None:
    """Checks a reply's tensors against the call that asked for them; raises StageOutputError.

    Boundary tensors must be in `dtype`; None takes float32 or bfloat16, for a caller that follows
    whatever the swarm computes in (the peer that takes the tensor next checks it against its own).
    A forward of a stage before the last returns hidden states [batch, seq, width]; a backward returns
    the gradient of its hidden input (same shape), or nothing at the first stage, whose inputs are tokens.
    """
    if not backward and stage == num_stages - 1:
        return  # the last stage's forward (logits) is not part of training: trainers call it backward only
    batch, seq = inputs[0].shape[:2]
    wanted = 0 if backward and stage == 0 else 1
    kind = "backward" if backward else "forward"
    if len(outputs) != wanted:
        raise StageOutputError(f"{kind} of stage {stage} answered {len(outputs)} tensors, expected {wanted}")
    for tensor in outputs:
        shape = (batch, seq, boundary_width)
        allowed = (torch.float32, torch.bfloat16) if dtype is None else (dtype,)
        if tensor.dtype not in allowed or tuple(tensor.shape) != shape:
            expected = " or ".join(f"{_name(d)}{list(shape)}" for d in allowed)
            raise StageOutputError(f"{kind} of stage {stage} answered {_describe(tensor)}, expected {expected}")
        if problem := value_problem(tensor):
            raise StageOutputError(f"{kind} of stage {stage} answered values that {problem}")
