"""A GPT-style byte-level language model, cut into pipeline stages.

Stage 0 holds the embeddings, the last stage the final norm, the head and the loss; the
transformer blocks are spread evenly between them. Each stage is an ordinary nn.Module, so the
whole model in one process is just the stages applied in order.

With a bottleneck in the spec, each stage boundary also gets a learned pair of projections: the
stage before it ends with `down` (d_model -> bottleneck), the stage after it starts with `up`
(bottleneck -> d_model), so the activations and gradients sent between peers are narrower.

With a subspace in the spec, the blocks write only the first `subspace` coordinates of the residual
stream; the others hold a fixed embedding of each token and position, the same on every stage. A stage
sends those learned coordinates, the next one takes them with the token ids and rebuilds the stream.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.kv_cache import LayerCache, causal_attention
from swarm.models.pipeline_stage import PipelineStage
from swarm.models.registry import ModelSpec


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_head = spec.n_head
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.learned_width)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # an inference session: the cached positions come before these
            y = causal_attention(q, *cache.extend(k, v))
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
            nn.Linear(spec.mlp_ratio * spec.d_model, spec.learned_width),
        )

    def forward(
        self, x: torch.Tensor, fixed: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """`x` is the learned part of the residual stream; `fixed`, with a subspace, the rest of it; `cache`, in an
        inference session, the keys and values of the positions before x's."""
        x = x + self.attn(self.ln1(_whole_stream(x, fixed)), cache)
        return x + self.mlp(self.ln2(_whole_stream(x, fixed)))


def _whole_stream(learned: torch.Tensor, fixed: torch.Tensor | None) -> torch.Tensor:
    return learned if fixed is None else torch.cat([learned, fixed], dim=-1)


def partition_layers(n_layer: int, num_stages: int, stage_blocks: tuple[int, ...] = ()) -> list[range]:
    """Which blocks each stage holds: `stage_blocks` of them where given (an uneven cut), else as even as
    possible, earlier stages taking the remainder."""
    if not 1 <= num_stages:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if stage_blocks and (len(stage_blocks) != num_stages or sum(stage_blocks) != n_layer):
        raise ValueError(f"stage blocks {list(stage_blocks)} are not {num_stages} counts adding up to {n_layer}")
    base, extra = divmod(n_layer, num_stages)
    counts = stage_blocks or tuple(base + (1 if stage < extra else 0) for stage in range(num_stages))
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


class GPTStage(PipelineStage):
    """One pipeline stage of the GPT model.

    Inputs: token ids [batch, seq] on stage 0, hidden states [batch, seq, spec.boundary_width]
    elsewhere, and with a subspace also the token ids (`tokens`). Output: hidden states
    [batch, seq, spec.boundary_width], or on the last stage [batch, seq, d_model] without targets and,
    given targets, the loss of each sample [batch] (cross-entropy averaged over the sample's tokens).
    """

    def __init__(self, spec: ModelSpec, stage: int, num_stages: int) -> None:
        super().__init__(spec, stage, num_stages)
        self.takes_tokens = spec.later_stages_take_tokens and not self.is_first  # besides the hidden states
        if self.is_first:
            self.tok_emb = nn.Embedding(spec.vocab_size, spec.learned_width)
            self.pos_emb = nn.Embedding(spec.seq_len, spec.learned_width)
        if spec.subspace:
            # not in the state dict: they follow from the spec, so a newcomer that downloads only the
            # parameters, or a checkpoint, has them already
            tok_fixed, pos_fixed = _fixed_embedding(spec)
            self.register_buffer("tok_fixed", tok_fixed, persistent=False)
            self.register_buffer("pos_fixed", pos_fixed, persistent=False)
        self.blocks = nn.ModuleList(
            Block(spec) for _ in partition_layers(spec.n_layer, num_stages, spec.stage_blocks)[stage]
        )
        if self.is_last:
            self.ln_f = nn.LayerNorm(spec.d_model)
            self.head = nn.Linear(spec.d_model, spec.vocab_size)
        # The boundary projections: None without a bottleneck and at the pipeline's ends. build_stage
        # initializes them apart from the rest, which therefore start as they would without a bottleneck.
        self.up: nn.Linear | None = None
        self.down: nn.Linear | None = None
        if spec.bottleneck:
            if not self.is_first:
                self.up = nn.Linear(spec.bottleneck, spec.d_model)
            if not self.is_last:
                self.down = nn.Linear(spec.d_model, spec.bottleneck)

    def enter(
        self, x: torch.Tensor, tokens: torch.Tensor | None = None, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's input made into the residual stream the blocks take, and the context they share
        (with a subspace, the fixed part of the stream; otherwise None). Its positions begin at `start`."""
        fixed = None
        if self.spec.subspace:
            ids = x if self.is_first else tokens
            if ids is None:
                raise ValueError(f"stage {self.stage} of {self.spec.name} takes the token ids with its hidden states")
            fixed = self.tok_fixed[ids] + self.pos_fixed[start : start + ids.shape[1]]
        if self.is_first:
            positions = torch.arange(start, start + x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(positions)
        elif self.up is not None:
            x = self.up(x)
        return x, fixed

    def leave(self, x: torch.Tensor, targets: torch.Tensor | None, fixed: torch.Tensor | None) -> torch.Tensor:
        """What the stage returns from the blocks' output: the boundary tensor, or on the last stage the
        whole stream (no targets) or each sample's loss."""
        if not self.is_last:
            return x if self.down is None else self.down(x)
        x = _whole_stream(x, fixed)
        if targets is None:
            return x
        logits = self.logits(x)
        token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return token_loss.view(targets.shape).mean(dim=1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's next-token logits [batch, seq, vocab] from the whole stream `leave` returns."""
        return self.head(self.ln_f(hidden))


def _boundary_basis(spec: ModelSpec, boundary: int, seed: int) -> torch.Tensor:
    """A random [d_model, bottleneck] matrix shared by the two stages on either side of `boundary`.

    Boundary k lies between stages k and k + 1; both draw this matrix from their own copy of a
    generator keyed by (seed, k), so it depends only on what each stage already knows.
    """
    # A stream apart from the stages' own (seed * 1_000_003 + stage) generators.
    generator = torch.Generator().manual_seed((seed * 1_000_003 + boundary) ^ 0x5EED_B077)
    return torch.randn(spec.d_model, spec.bottleneck, generator=generator)


def _fixed_embedding(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed part of a subspace model's token and position embeddings: [vocab, d_model - subspace]
    and [seq_len, d_model - subspace], scaled like the learned ones at initialization.

    It depends on the spec alone, not on the seed, so every peer agrees on it whatever its --seed.
    """
    generator = torch.Generator().manual_seed(0x5EED_F1ED)
    width = spec.d_model - spec.subspace
    tokens = torch.randn(spec.vocab_size, width, generator=generator) * 0.02
    return tokens, torch.randn(spec.seq_len, width, generator=generator) * 0.02


def build_stage(spec: ModelSpec, stage: int, num_stages: int, seed: int = 0) -> GPTStage:
    """Builds a stage with initial parameters that depend only on (spec, stage, num_stages, seed).

    Every replica of a stage therefore starts identical, and so does a one-process reference.
    With a bottleneck, the parameters shared with the spec without one start exactly as they would
    there; the projections at a boundary start tied, up = down^T = G / sqrt(d_model) for a Gaussian
    G [d_model, bottleneck]: up(down(x)) = G G^T x / d_model then keeps x's component in a random
    bottleneck-wide subspace (eigenvalues scattered around 1) instead of scrambling the hidden state.
    """
    module = GPTStage(spec, stage, num_stages)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stage)
    residual_std = 0.02 / math.sqrt(2 * spec.n_layer)
    for name, param in module.named_parameters():
        if name.startswith(("up.", "down.")):
            continue  # initialized below, from the boundary's generator: the stage's stream stays as without them
        if name.endswith("bias"):
            nn.init.zeros_(param)
        elif ".ln" in name or name.startswith("ln_"):
            nn.init.ones_(param)
        elif name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
            nn.init.normal_(param, std=residual_std, generator=generator)
        else:
            nn.init.normal_(param, std=0.02, generator=generator)
    scale = 1 / math.sqrt(spec.d_model)
    with torch.no_grad():
        # Elementwise scaling only (no QR): bit-identical on every machine, like the rest of the init.
        if module.up is not None:
            module.up.weight.copy_(_boundary_basis(spec, stage - 1, seed) * scale)
            module.up.bias.zero_()
        if module.down is not None:
            module.down.weight.copy_(_boundary_basis(spec, stage, seed).T * scale)
            module.down.bias.zero_()
    return module
