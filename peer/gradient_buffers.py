"""Gradients accumulated toward a step, with the microbatches in them, set aside and put back as one.

While a stage's averaging round runs, its peer goes on accumulating the backwards that arrive: into
fresh buffers, toward the next step, while the round sums what was there when it began. The round's
own gradients are set aside (`take`) and come back (`put`) if it fails, so a retry holds exactly them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from swarm.peer.request_queue import SampleKey


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


def flat_gradient(module: nn.Module) -> torch.Tensor:
    """The module's gradient sums as one float32 vector on the host (zeros where a parameter has none)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
            for p in module.parameters()
        ]
    )


def set_gradients(module: nn.Module, flat: torch.Tensor) -> None:
    """Makes the slices of one flat vector (see `flat_gradient`) the module's gradients, on their devices."""
    offset = 0
    for param in module.parameters():
        numel = param.numel()
        param.grad = flat[offset : offset + numel].view_as(param).to(param.device, param.dtype)
        offset += numel


def gradients_finite(module: nn.Module) -> bool:
    """Whether no gradient of the module holds NaN or infinity."""
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in module.parameters())
