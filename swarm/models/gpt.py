"""A GPT-style byte-level language model, cut into pipeline stages.

Stage 0 holds the embeddings, the last stage the final norm, the head and the loss; the
transformer blocks are spread evenly between them. Each stage is an ordinary nn.Module, so the
whole model in one process is just the stages applied in order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.registry import ModelSpec


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_head = spec.n_head
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.d_model)
        self.attn = CausalSelfAttention(spec)
        self.ln2 = nn.LayerNorm(spec.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(spec.d_model, spec.mlp_ratio * spec.d_model),
            nn.GELU(),
            nn.Linear(spec.mlp_ratio * spec.d_model, spec.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def partition_layers(n_layer: int, num_stages: int) -> list[range]:
    """Which blocks each stage holds: as even as possible, earlier stages take the remainder."""
    if not 1 <= num_stages:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    base, extra = divmod(n_layer, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append(range(start, end))
        start = end
    return bounds


class GPTStage(nn.Module):
    """One pipeline stage of the GPT model.

    Inputs: token ids [batch, seq] on stage 0, hidden states [batch, seq, d_model] elsewhere.
    Output: hidden states, or on the last stage, given targets, the loss of each sample [batch]
    (cross-entropy averaged over the sample's tokens).
    """

    def __init__(self, spec: ModelSpec, stage: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is out of range for {num_stages} stages")
        self.spec, self.stage, self.num_stages = spec, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
            self.pos_emb = nn.Embedding(spec.seq_len, spec.d_model)
        self.blocks = nn.ModuleList(Block(spec) for _ in partition_layers(spec.n_layer, num_stages)[stage])
        if self.is_last:
            self.ln_f = nn.LayerNorm(spec.d_model)
            self.head = nn.Linear(spec.d_model, spec.vocab_size)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        if not self.is_last or targets is None:
            return x
        logits = self.head(self.ln_f(x))
        token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return token_loss.view(targets.shape).mean(dim=1)


def build_stage(spec: ModelSpec, stage: int, num_stages: int, seed: int = 0) -> GPTStage:
    """Builds a stage with initial parameters that depend only on (spec, stage, num_stages, seed).

    Every replica of a stage therefore starts identical, and so does a one-process reference.
    """
    module = GPTStage(spec, stage, num_stages)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stage)
    residual_std = 0.02 / math.sqrt(2 * spec.n_layer)
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(param)
        elif ".ln" in name or name.startswith("ln_"):
            nn.init.ones_(param)
        elif name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
            nn.init.normal_(param, std=residual_std, generator=generator)
        else:
            nn.init.normal_(param, std=0.02, generator=generator)
    return module
