"""What a stage keeps of an inference session between calls: each block's keys and values (the KV cache).

A generation session sends a prompt once, then one token at a time; each block keeps the keys and values of
every position so far, so a new token attends to them without recomputing the prefix. Positions continue
from `StageCache.length`: the stage's `enter` offsets its position embeddings (GPT) or rotary angles (Llama)
by it, and `causal_attention` lets each new position see the whole cached prefix and the new ones before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerCache:
    """One block's cached keys and values, [batch, heads, positions, head_dim] each (None before the first call)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new positions' keys and values; returns those of every position so far."""
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        return self.keys, self.values


class StageCache:
    """A stage's KV cache for one session: a `LayerCache` per block and the positions it holds."""

    def __init__(self, num_blocks: int) -> None:
        self.layers = [LayerCache() for _ in range(num_blocks)]
        self.length = 0  # positions cached so far: the next call's first position

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds."""
        tensors = [t for layer in self.layers for t in (layer.keys, layer.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q's positions over k's, where q's are k's last ones (a cache holds the ones before).

    Without a prefix this is the usual causal attention; one new position sees every key; several new ones
    see the prefix and, among themselves, the ones up to their own (a mask aligned to the bottom right, which
    `is_causal` is not when the two lengths differ).
    """
    new, total = q.shape[2], k.shape[2]
    if new == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if new == 1:
        return F.scaled_dot_product_attention(q, k, v)
    past = total - new
    rows = torch.arange(new, device=q.device)[:, None] + past
    mask = torch.arange(total, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
