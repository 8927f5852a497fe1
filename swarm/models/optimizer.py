"""The optimizer of a stage and the rule that turns accumulated gradients into one step.

Stages backpropagate the *sum* of per-sample losses, so accumulated gradients are sums over every
sample the stage has seen; dividing by that count at step time gives the gradient of the mean
loss over the global batch, however the batch was cut into microbatches or merged on a peer.
Peers and the one-process reference share this module, which is what makes them comparable.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

import torch
from torch import nn

# Optimizer methods that torch wraps with `torch._disable_dynamo`, whose first call imports torch._dynamo
_DYNAMO_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
FUSED_DEVICES = ("cpu", "cuda")  # where torch's fused AdamW runs; elsewhere the per-parameter loop


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW hyperparameters; every replica of every stage must use the same ones."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95


def _skip_dynamo_at_construction() -> None:
    """Spares building an optimizer the import of torch._dynamo (about 1 s, most of a newcomer's start).

    torch wraps these methods so that a torch.compile'd caller does not trace into them, and the wrapper's
    first call imports the compiler. No stage is compiled, so each is marked as wrapped already. Where torch
    is built otherwise (no `__wrapped__`), nothing changes.
    """
    for name in _DYNAMO_WRAPPED:
        original = getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None)
        if callable(original) and not hasattr(original, "__dynamo_disable"):
            original.__dynamo_disable = original


def import_compiler_in_background() -> threading.Thread:
    """Imports torch._dynamo on a thread: an optimizer's first step needs it, and would otherwise spend that
    second inside the stage's first step, holding up its mates. Start it only after the DHT has forked."""
    thread = threading.Thread(
        target=importlib.import_module, args=("torch._dynamo",), name="import-torch-dynamo", daemon=True
    )
    thread.start()
    return thread


def build_optimizer(module: nn.Module, settings: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or position tables)."""
    _skip_dynamo_at_construction()
    decay = [p for name, p in module.named_parameters() if p.ndim >= 2 and "pos_emb" not in name]
    no_decay = [p for name, p in module.named_parameters() if not (p.ndim >= 2 and "pos_emb" not in name)]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused: one kernel per parameter on the host, a few per device on a GPU (3-6 times faster than the per-parameter
    # loop on gpt-tiny's stages: every replica steps every step, and every standby holder once per step delta).
    # The arithmetic is the fused kernel's alike for every replica, holder and the one-process reference
    fused = all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in module.parameters())
    return torch.optim.AdamW(
        [group for group in groups if group["params"]],
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
        foreach=None if fused else False,
        fused=fused,
    )


def steps_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps each parameter's step count on the parameter's device (a fused one does)."""
    return bool(optimizer.defaults.get("fused"))


def apply_accumulated_step(module: nn.Module, optimizer: torch.optim.Optimizer, num_samples: int) -> None:
    """Steps on the gradients summed over `num_samples` samples, then clears them."""
    if num_samples <= 0:
        raise ValueError("cannot step on zero accumulated samples")
    with torch.no_grad():
        for param in module.parameters():
            if param.grad is not None:
                param.grad.div_(num_samples)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
