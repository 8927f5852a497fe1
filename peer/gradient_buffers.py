"""Gradients accumulated toward a step, with the microbatches in them, set aside and put back as one.

While a stage's averaging round runs, its peer goes on accumulating the backwards that arrive: into
fresh buffers, toward the next step, while the round sums what was there when it began. The round's
own gradients are set aside (`take`) and come back (`put`) if it fails, with what came in during it
(`merged`): the step was not taken, so its retry sums every backward that has arrived toward it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from swarm.peer.request_queue import SampleKey

FLAT_CHUNK = 1 << 25  # elements joined on a device before one copy to the host: bounds the device memory taken


@dataclass
class Accumulated:
    """Gradient sums of a module's parameters (None where none yet), the microbatches in them, their samples."""

    grads: list[torch.Tensor | None] = field(default_factory=list)
    held: dict[SampleKey, int] = field(default_factory=dict)
    samples: int = 0


def take(module: nn.Module, held: dict[SampleKey, int], samples: int) -> Accumulated:
    """The module's accumulated gradients (and what they hold), which leave its parameters."""
    params = list(module.parameters())
    taken = Accumulated([p.grad for p in params], dict(held), samples)
    for param in params:
        param.grad = None
    return taken


def put(module: nn.Module, accumulated: Accumulated) -> None:
    """Puts gradients set aside back on the module's parameters (whose own gradients must be empty)."""
    for param, grad in zip(module.parameters(), accumulated.grads):
        param.grad = grad


def merged(first: Accumulated, second: Accumulated) -> Accumulated:
    """`first` with `second` added to it (gradient sums, microbatches and samples): one accumulation of both."""
    grads = [a if b is None else b if a is None else a.add_(b) for a, b in zip(first.grads, second.grads, strict=True)]
    held = dict(first.held)
    for key, n in second.held.items():
        held[key] = held.get(key, 0) + n
    return Accumulated(grads, held, first.samples + second.samples)


def flat_gradient(module: nn.Module) -> torch.Tensor:
    """The module's gradient sums as one float32 vector on the host (zeros where a parameter has none)."""
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in module.parameters()]
    flat = torch.empty(sum(grad.numel() for grad in grads), dtype=torch.float32)
    offset = 0
    for run in _device_runs(grads, FLAT_CHUNK):
        joined = run[0] if len(run) == 1 else torch.cat(run)
        flat[offset : offset + joined.numel()].copy_(joined)  # casts to float32 on the way
        offset += joined.numel()
    return flat


def _device_runs(grads: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """The gradients in order, those on an accelerator in runs of one device up to `limit` elements (joined
    there, they cross to the host in one copy rather than a copy per parameter, each waiting on the device);
    those on the host one by one (each is copied straight into place)."""
    run: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        if run and (grad.device != run[0].device or size + grad.numel() > limit):
            yield run
            run, size = [], 0
        if grad.device.type == "cpu":
            yield [grad]
            continue
        run.append(grad)
        size += grad.numel()
    if run:
        yield run


def set_gradients(module: nn.Module, flat: torch.Tensor) -> None:
    """Makes the slices of one flat vector (see `flat_gradient`) the module's gradients, on their devices."""
    params = list(module.parameters())
    devices = {param.device for param in params}
    source = flat.to(devices.pop()) if len(devices) == 1 else flat  # one copy to a device, not one per parameter
    offset = 0
    for param in params:
        numel = param.numel()
        param.grad = source[offset : offset + numel].view_as(param).to(param.device, param.dtype)
        offset += numel


def gradients_finite(module: nn.Module) -> bool:
    """Whether no gradient of the module holds NaN or infinity."""
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in module.parameters())
