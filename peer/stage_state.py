"""A stage's state as a list of tensors: what a joining peer downloads from its stage-mates.

The list is the parameters in module order, then, once the optimizer has stepped, AdamW's first
moments, second moments and per-parameter step counts in the same order. It travels as ordinary
wire tensors, so nothing a remote sends is ever unpickled; the receiver checks every count, shape
and dtype against its own freshly built stage before it copies anything in.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

MOMENTS = ("exp_avg", "exp_avg_sq")


class StageStateError(ValueError):
    """A state from a mate that does not fit this peer's stage."""


def state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], bool]:
    """Copies of the stage's parameters and optimizer state; returns (tensors, has_optimizer_state)."""
    params = list(module.parameters())
    tensors = [p.detach().cpu().clone() for p in params]
    states = [optimizer.state.get(p, {}) for p in params]
    has_optimizer_state = all(all(key in state for key in (*MOMENTS, "step")) for state in states)
    if has_optimizer_state:
        for key in MOMENTS:
            tensors += [state[key].detach().cpu().clone() for state in states]
        tensors += [torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().clone() for state in states]
    return tensors, has_optimizer_state


def check_state_tensors(module: nn.Module, tensors: list[torch.Tensor], has_optimizer_state: bool) -> None:
    """Raises StageStateError unless `tensors` is a full state of this stage."""
    params = list(module.parameters())
    expected = len(params) * (4 if has_optimizer_state else 1)
    if len(tensors) != expected:
        raise StageStateError(f"expected {expected} tensors of state, got {len(tensors)}")
    shapes = [p.shape for p in params] * (3 if has_optimizer_state else 1)
    for index, (tensor, shape) in enumerate(zip(tensors, shapes)):
        if tensor.shape != shape or not tensor.is_floating_point():
            raise StageStateError(f"state tensor {index} is {tensor.dtype}{list(tensor.shape)}, expected {list(shape)}")
        if not torch.isfinite(tensor).all():
            raise StageStateError(f"state tensor {index} holds NaN or infinity")
    for tensor in tensors[len(shapes) :]:
        if tensor.numel() != 1 or not tensor.is_floating_point() or float(tensor) < 0:
            raise StageStateError("optimizer step counts must be non-negative scalars")


def load_state_tensors(
    module: nn.Module, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], has_optimizer_state: bool
) -> None:
    """Copies a checked state into the stage's parameters and optimizer (call on the runtime thread)."""
    check_state_tensors(module, tensors, has_optimizer_state)
    params = list(module.parameters())
    count = len(params)
    with torch.no_grad():
        for param, value in zip(params, tensors[:count]):
            param.copy_(value.to(param.device, param.dtype))
    optimizer.state.clear()
    if not has_optimizer_state:
        return
    for index, param in enumerate(params):
        optimizer.state[param] = {
            "step": tensors[3 * count + index].reshape(()).clone().float(),
            "exp_avg": tensors[count + index].to(param.device, param.dtype).clone(),
            "exp_avg_sq": tensors[2 * count + index].to(param.device, param.dtype).clone(),
        }


def state_fingerprint(tensors: list[torch.Tensor]) -> str:
    """A short hash of a state's exact bits, to compare replicas in logs."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def parameter_fingerprint(module: nn.Module) -> str:
    """A short hash of the parameters' exact bits: replicas of a stage that agree show the same."""
    return state_fingerprint([param.detach() for param in module.parameters()])
