"""The optimizer of a stage and the rule that turns accumulated gradients into one step.

Stages backpropagate the *sum* of per-sample losses, so accumulated gradients are sums over every
sample the stage has seen; dividing by that count at step time gives the gradient of the mean
loss over the global batch, however the batch was cut into microbatches or merged on a peer.
Peers and the one-process reference share this module, which is what makes them comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW hyperparameters; every replica of every stage must use the same ones."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95


def build_optimizer(module: nn.Module, settings: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or position tables)."""
    decay = [p for name, p in module.named_parameters() if p.ndim >= 2 and "pos_emb" not in name]
    no_decay = [p for name, p in module.named_parameters() if not (p.ndim >= 2 and "pos_emb" not in name)]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: the same per-parameter arithmetic whatever the stage's size
    return torch.optim.AdamW(
        [group for group in groups if group["params"]],
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
        foreach=False,
    )


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
