"""A stage's state: one named mapping of tensors, and the list of them that a joining peer downloads.

By name (what checkpoints and standby spills keep, see `state_file`): `param.<name>` for each of
`module.named_parameters()`, then, for each key of the optimizer's per-parameter state (AdamW's
exp_avg, exp_avg_sq and step first), `<key>.<name>` for every parameter that has it.

On the wire: the parameters in module order, then, once the optimizer has stepped, AdamW's first
moments, second moments and per-parameter step counts in the same order. It travels as ordinary
wire tensors, so nothing a remote sends is ever unpickled; the receiver checks every count, shape
and dtype against its own freshly built stage before it copies anything in.
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from swarm.models.optimizer import steps_on_device

PARAM = "param"
MOMENTS = ("exp_avg", "exp_avg_sq")
WIRE_KEYS = (*MOMENTS, "step")  # the optimizer's per-parameter state that travels, in the wire's order


class StageStateError(ValueError):
    """A state from a mate that does not fit this peer's stage."""


def state_key(key: str, name: str) -> str:
    """The name of one tensor of state: `param.<name>` for a parameter, `<key>.<name>` for optimizer state."""
    return f"{key}.{name}"


def split_state_key(entry: str) -> tuple[str, str]:
    """(key, parameter name) of a tensor of state; parameter names may hold dots, keys never do."""
    key, _, name = entry.partition(".")
    return key, name


def named_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The stage's state by name, detached and on the CPU (where it lives there already, not copied)."""
    params = list(module.named_parameters())
    state = {state_key(PARAM, name): param.detach().cpu() for name, param in params}
    per_param = [(name, optimizer.state.get(param, {})) for name, param in params]
    others = sorted({key for _, values in per_param for key in values} - set(WIRE_KEYS))
    for key in (*WIRE_KEYS, *others):
        dtype = torch.float32 if key == "step" else None  # the wire's step counts are float32 scalars
        for name, values in per_param:
            if values.get(key) is not None:
                state[state_key(key, name)] = torch.as_tensor(values[key], dtype=dtype).detach().cpu()
    return state


def wire_tensors(state: dict[str, torch.Tensor], names: list[str]) -> tuple[list[torch.Tensor], bool]:
    """A named state in the wire's order for parameters `names`; returns (tensors, has_optimizer_state).

    The optimizer's state travels only if every parameter has all of `WIRE_KEYS`."""
    tensors = [state[state_key(PARAM, name)] for name in names]
    has_optimizer_state = all(state_key(key, name) in state for key in WIRE_KEYS for name in names)
    if has_optimizer_state:
        tensors += [state[state_key(key, name)] for key in WIRE_KEYS for name in names]
    return tensors, has_optimizer_state


def state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], bool]:
    """Copies of the stage's parameters and optimizer state; returns (tensors, has_optimizer_state)."""
    names = [name for name, _ in module.named_parameters()]
    tensors, has_optimizer_state = wire_tensors(named_state(module, optimizer), names)
    return [tensor.clone() for tensor in tensors], has_optimizer_state


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
    fused = steps_on_device(optimizer)
    for index, param in enumerate(params):
        optimizer.state[param] = {
            "step": tensors[3 * count + index].reshape(()).to(param.device if fused else "cpu").clone().float(),
            "exp_avg": tensors[count + index].to(param.device, param.dtype).clone(),
            "exp_avg_sq": tensors[2 * count + index].to(param.device, param.dtype).clone(),
        }


def state_fingerprint(tensors: list[torch.Tensor]) -> str:
    """A short hash of a state's exact bits, to compare replicas (and to name a step's parameters in records).

    SHA-256 of the SHA-256 of each piece of at most FINGERPRINT_PIECE_BYTES of each tensor, the pieces hashed
    in parallel threads (hashlib lets go of the GIL): a stage's fingerprint is taken at every step, and over a
    GPU stage's hundreds of MB one hash in one thread would take a good share of the step."""
    pieces = []
    for tensor in tensors:
        flat = tensor.detach().cpu().reshape(-1).contiguous()
        data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        pieces += [data[i : i + FINGERPRINT_PIECE_BYTES] for i in range(0, len(data), FINGERPRINT_PIECE_BYTES)]
        pieces.append(memoryview(len(data).to_bytes(8, "big")))  # where one tensor ends and the next starts
    if sum(len(piece) for piece in pieces) <= FINGERPRINT_PIECE_BYTES:
        digests = [hashlib.sha256(piece).digest() for piece in pieces]
    else:
        digests = list(_hashing_threads().map(lambda piece: hashlib.sha256(piece).digest(), pieces))
    return hashlib.sha256(b"".join(digests)).hexdigest()[:16]


FINGERPRINT_PIECE_BYTES = 4 * 2**20


@functools.cache
def _hashing_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="fingerprint")


def parameter_fingerprint(module: nn.Module) -> str:
    """A short hash of the parameters' exact bits: replicas of a stage that agree show the same."""
    return state_fingerprint([param.detach() for param in module.parameters()])
