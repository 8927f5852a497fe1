"""Model specs by name: the presets a swarm can train."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Bytes 0..255 plus one special: the end-of-document separator placed between corpus files.
BYTE_VOCAB_SIZE = 257
EOD_TOKEN = 256


FAMILIES = ("gpt", "llama")


@dataclass(frozen=True)
class ModelSpec:
    """A causal language model, described fully enough for every peer to build its stage.

    `family` picks the architecture: "gpt" (swarm.models.gpt: learned positions, LayerNorm, GELU MLP) or
    "llama" (swarm.models.llama: rotary positions, RMSNorm, SwiGLU MLP of `ffn_hidden`, grouped-query
    attention with `n_kv_head` key/value heads, no biases). The fields after `subspace` are Llama's only.

    `bottleneck` > 0 makes the model compression-aware, as evaluated in the SWARM parallelism paper:
    every stage but the last ends with a learned projection d_model -> bottleneck, every stage but the
    first starts with one bottleneck -> d_model, so only `bottleneck` values per token cross the wire.
    0 (the default) leaves the full hidden state at the boundaries.

    `subspace` > 0 instead keeps the boundary exact: every block writes into only the first `subspace`
    coordinates of the residual stream, the rest of it holds a fixed embedding of each token and position
    that every stage recomputes from the token ids, so a stage sends the `subspace` learned coordinates
    and the token ids, and the next stage rebuilds the whole stream from them without loss. The model
    pays in capacity (a narrower learned stream), not in noise at the boundary.
    """

    name: str
    seq_len: int
    d_model: int
    n_layer: int
    n_head: int
    vocab_size: int = BYTE_VOCAB_SIZE
    mlp_ratio: int = 4
    bottleneck: int = 0
    subspace: int = 0
    family: str = "gpt"
    n_kv_head: int = 0  # key/value heads of grouped-query attention; 0: as many as n_head
    ffn_hidden: int = 0  # width of the SwiGLU MLP
    rope_theta: float = 10000.0  # base wavelength of the rotary position embedding
    # Llama 3's stretch of the rotary wavelengths: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None: plain rotary embedding
    rope_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    # blocks of each stage, first to last, where the cut is uneven (`--stage-blocks`, `swarm plan`); (): as even
    # as possible, earlier stages taking the remainder
    stage_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"{self.name}: family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.family == "llama":
            self._check_llama()
        elif self.n_kv_head or self.ffn_hidden or self.rope_scaling:
            raise ValueError(f"{self.name}: n_kv_head, ffn_hidden and rope_scaling are settings of the llama family")
        if self.d_model % self.n_head:
            raise ValueError(f"{self.name}: d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.bottleneck < 0:
            raise ValueError(f"{self.name}: bottleneck must be 0 (off) or positive, got {self.bottleneck}")
        if not 0 <= self.subspace < self.d_model:
            raise ValueError(f"{self.name}: subspace must be 0 (off) or 1..{self.d_model - 1}, got {self.subspace}")
        if self.subspace and self.bottleneck:
            raise ValueError(f"{self.name}: a bottleneck and a subspace do not combine; choose one")
        if self.stage_blocks and (min(self.stage_blocks) < 1 or sum(self.stage_blocks) != self.n_layer):
            raise ValueError(
                f"{self.name}: stage blocks {list(self.stage_blocks)} must each be at least 1 and add up to its "
                f"{self.n_layer} blocks"
            )

    def _check_llama(self) -> None:
        if self.bottleneck or self.subspace:
            raise ValueError(f"{self.name}: a llama model takes no bottleneck or subspace")
        if self.ffn_hidden < 1:
            raise ValueError(f"{self.name}: a llama model needs ffn_hidden (the MLP's width), got {self.ffn_hidden}")
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ValueError(f"{self.name}: n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(f"{self.name}: the rotary embedding needs an even head width, d_model / n_head")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"{self.name}: rope_theta and norm_eps must be positive")
        if self.rope_scaling is not None and len(self.rope_scaling) != 4:
            raise ValueError(f"{self.name}: rope_scaling is (factor, low_freq_factor, high_freq_factor, original_len)")

    @property
    def boundary_width(self) -> int:
        """Width of the hidden states passed between stages: [batch, seq, boundary_width] on the wire."""
        return self.bottleneck or self.subspace or self.d_model

    @property
    def later_stages_take_tokens(self) -> bool:
        """Whether every stage after the first takes the token ids beside the hidden states (a subspace
        model rebuilds the fixed part of its residual stream from them)."""
        return self.subspace > 0

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the attention: n_kv_head, or n_head where that is 0."""
        return self.n_kv_head or self.n_head

    @property
    def learned_width(self) -> int:
        """How many coordinates of the residual stream the blocks and the learned embeddings write."""
        return self.subspace or self.d_model

    def num_parameters(self, num_stages: int = 1) -> int:
        """Parameters of the whole model (all stages together) when cut into `num_stages` stages.

        The count depends on `num_stages` only with a bottleneck: each of the num_stages - 1
        boundaries holds one down and one up projection.
        """
        if self.family == "llama":
            d, kv_width = self.d_model, self.kv_heads * (self.d_model // self.n_head)
            # q and o, then k and v, then the SwiGLU's three matrices, then the two norms
            per_block = 2 * d * d + 2 * d * kv_width + 3 * d * self.ffn_hidden + 2 * d
            # the embedding, the final norm and the head (its own matrix even where a checkpoint ties it)
            return self.vocab_size * d + self.n_layer * per_block + d + d * self.vocab_size
        d, w, m = self.d_model, self.learned_width, self.mlp_ratio
        # qkv, then the two projections that write the residual stream (w wide), then norms
        per_block = (3 + m) * d * d + (1 + m) * d * w + (7 + m) * d + 2 * w
        embeddings = self.vocab_size * w + self.seq_len * w
        head = 2 * d + d * self.vocab_size + self.vocab_size
        b = self.bottleneck
        per_boundary = (d * b + b) + (b * d + d) if b else 0
        return embeddings + self.n_layer * per_block + head + (num_stages - 1) * per_boundary


def _llama(n_kv_head: int, ffn_hidden: int, vocab_size: int = BYTE_VOCAB_SIZE) -> dict:
    return {"family": "llama", "n_kv_head": n_kv_head, "ffn_hidden": ffn_hidden, "vocab_size": vocab_size}


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # CPU demo and tests: trains visibly within a minute or two on 2 cores
        ModelSpec("gpt-tiny", seq_len=64, d_model=128, n_layer=6, n_head=4),
        # gpt-tiny with a learned bottleneck at stage boundaries: 4x fewer values on the wire
        ModelSpec("gpt-tiny-bottleneck", seq_len=64, d_model=128, n_layer=6, n_head=4, bottleneck=32),
        # gpt-tiny whose blocks write 24 of the residual stream's 128 coordinates: 5.3x fewer values, sent exactly
        ModelSpec("gpt-tiny-subspace", seq_len=64, d_model=128, n_layer=6, n_head=4, subspace=24),
        # simulated devices (--simulated-speed): real compute this small leaves room for dozens of peers
        ModelSpec("gpt-micro", seq_len=16, d_model=32, n_layer=8, n_head=2),
        # GPU presets
        ModelSpec("gpt-small", seq_len=512, d_model=768, n_layer=12, n_head=12),
        ModelSpec("gpt-medium", seq_len=1024, d_model=1024, n_layer=24, n_head=16),
        ModelSpec("gpt-large", seq_len=1024, d_model=1536, n_layer=24, n_head=16),
        ModelSpec("gpt-xl", seq_len=1024, d_model=2048, n_layer=24, n_head=16),
        # Llama-style: CPU demo and tests, on bytes like gpt-tiny
        ModelSpec("llama-tiny", seq_len=64, d_model=128, n_layer=6, n_head=4, **_llama(2, 344)),
        # GPU presets: gpt-small's size, then the shapes of TinyLlama-1.1B and Llama-3.2-1B (trained from scratch;
        # to fine-tune the published weights, start from their folder with --hf-checkpoint)
        ModelSpec("llama-small", seq_len=512, d_model=768, n_layer=12, n_head=12, **_llama(4, 2048)),
        ModelSpec("llama-1.1b", seq_len=2048, d_model=2048, n_layer=22, n_head=32, **_llama(4, 5632, 32000)),
        ModelSpec(
            "llama-3.2-1b",
            seq_len=2048,
            d_model=2048,
            n_layer=16,
            n_head=32,
            **_llama(8, 8192, 128256),
            rope_theta=500000.0,
            rope_scaling=(32.0, 1.0, 4.0, 8192),
        ),
    )
}


def get_model_spec(name: str, **overrides: int | tuple[int, ...]) -> ModelSpec:
    """The registered spec called `name`, optionally with some fields replaced."""
    try:
        spec = MODELS[name]
    except KeyError:
        if name.startswith("hf:"):
            raise ValueError(f"model {name!r} is a checkpoint's: give its folder with --hf-checkpoint") from None
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None
    return replace(spec, **overrides) if overrides else spec
