"""A Llama-style language model, cut into pipeline stages like swarm.models.gpt.

The architecture of Llama 2 and 3 (and of the many models that share it): token embeddings without a
position table, blocks of pre-norm grouped-query attention with rotary position embeddings and a
SwiGLU MLP, RMSNorm everywhere, no biases. Stage 0 holds the token embedding, the last stage the final
norm, the head and the loss, and the blocks are spread between them as in gpt.py.

Parameter names follow Hugging Face's LlamaForCausalLM (`embed_tokens`, `self_attn.q_proj`, `mlp.gate_proj`,
`norm`, `lm_head`, with `blocks.i` for `model.layers.N`), so a published checkpoint loads by a plain rename
(swarm.models.hf_checkpoint). The arithmetic follows it too, down to the rotary embedding's convention:
the two halves of each head's query and key are the rotated pairs (`rotate_half`), as the weights are stored.

Where a checkpoint ties its head to its embedding, the last stage holds a copy of the embedding as its
head: stages live on different peers, and the copies then train apart (in one stage too, so every cut of
the model trains the same parameters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.gpt import partition_layers
from swarm.models.kv_cache import LayerCache, causal_attention
from swarm.models.pipeline_stage import PipelineStage
from swarm.models.registry import ModelSpec

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos and sin, [seq, head_dim] each: the context every block takes


class RMSNorm(nn.Module):
    """Scales each vector to unit root mean square (computed in float32), then by a learned gain."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_frequencies(spec: ModelSpec) -> torch.Tensor:
    """The rotary embedding's inverse wavelengths, [head_dim / 2], with Llama 3's stretch if the spec has one."""
    dim = spec.d_model // spec.n_head
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if spec.rope_scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, those between blended smoothly
    factor, low_freq_factor, high_freq_factor, original = spec.rope_scaling
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < original / high_freq_factor) * ~(wavelength > original / low_freq_factor)
    return torch.where(between, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query attention: n_head query heads share kv_heads key/value heads."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = spec.n_head, spec.kv_heads, spec.d_model // spec.n_head
        self.q_proj = nn.Linear(spec.d_model, spec.d_model, bias=False)
        self.k_proj = nn.Linear(spec.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.d_model, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor, rotary: Rotary, cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq, width = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = rotary
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:  # an inference session: the cached positions come before these (kept ungrouped)
            k, v = cache.extend(k, v)
        # query head h reads key/value head h // group, as in Hugging Face's repeat_kv
        group = self.n_head // self.n_kv_head
        k, v = (t[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) if cache is None else causal_attention(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.d_model, spec.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(spec.d_model, spec.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """x + attention(norm(x)), then + mlp(norm(...))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.d_model, spec.norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.d_model, spec.norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rotary: Rotary, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStage(PipelineStage):
    """One pipeline stage of a Llama-style model, in the shape of GPTStage.

    Inputs: token ids [batch, seq] on stage 0, hidden states [batch, seq, d_model] elsewhere. Output: hidden
    states [batch, seq, d_model], or on the last stage, given targets, the loss of each sample [batch]
    (cross-entropy averaged over the sample's tokens); without targets the final hidden states (`logits`
    turns them into the next token's logits).
    """

    # takes_tokens stays False: positions come from the rotary embedding, hidden states carry all a stage needs

    def __init__(self, spec: ModelSpec, stage: int, num_stages: int) -> None:
        if spec.family != "llama":
            raise ValueError(f"{spec.name} is a {spec.family} model, not a llama one")
        super().__init__(spec, stage, num_stages)
        if self.is_first:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.d_model)
        # not in the state dict: it follows from the spec, like GPTStage's fixed embeddings
        self.register_buffer("inv_freq", rotary_frequencies(spec), persistent=False)
        self.blocks = nn.ModuleList(
            Block(spec) for _ in partition_layers(spec.n_layer, num_stages, spec.stage_blocks)[stage]
        )
        if self.is_last:
            self.norm = RMSNorm(spec.d_model, spec.norm_eps)
            self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

    def enter(self, x: torch.Tensor, tokens: torch.Tensor | None = None, start: int = 0) -> tuple[torch.Tensor, Rotary]:
        """The stage's input as the residual stream, and the rotary cos and sin [seq, head_dim] its blocks share,
        for positions from `start` on."""
        hidden = self.embed_tokens(x) if self.is_first else x
        positions = torch.arange(start, start + x.shape[1], device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return hidden, (angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype))

    def leave(self, x: torch.Tensor, targets: torch.Tensor | None, context: Rotary | None = None) -> torch.Tensor:
        """The boundary tensor, or on the last stage the final hidden states (no targets) or each sample's loss."""
        if not self.is_last or targets is None:
            return x
        token_loss = F.cross_entropy(self.logits(x).flatten(0, 1), targets.flatten(), reduction="none")
        return token_loss.view(targets.shape).mean(dim=1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's next-token logits [batch, seq, vocab] from its final hidden states."""
        return self.lm_head(self.norm(hidden))


def build_llama_stage(spec: ModelSpec, stage: int, num_stages: int, seed: int = 0) -> LlamaStage:
    """Builds a stage with initial parameters that depend only on (spec, stage, num_stages, seed): normal with
    std 0.02, the projections that write the residual stream scaled down by sqrt(2 * n_layer), norms at one."""
    module = LlamaStage(spec, stage, num_stages)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stage)
    residual_std = 0.02 / math.sqrt(2 * spec.n_layer)
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            nn.init.normal_(param, std=residual_std, generator=generator)
        else:
            nn.init.normal_(param, std=0.02, generator=generator)
    return module
