"""Model specs by name: the presets a swarm can train."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Bytes 0..255 plus one special: the end-of-document separator placed between corpus files.
BYTE_VOCAB_SIZE = 257
EOD_TOKEN = 256


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style causal language model, described fully enough for every peer to build its stage.

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

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"{self.name}: d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.bottleneck < 0:
            raise ValueError(f"{self.name}: bottleneck must be 0 (off) or positive, got {self.bottleneck}")
        if not 0 <= self.subspace < self.d_model:
            raise ValueError(f"{self.name}: subspace must be 0 (off) or 1..{self.d_model - 1}, got {self.subspace}")
        if self.subspace and self.bottleneck:
            raise ValueError(f"{self.name}: a bottleneck and a subspace do not combine; choose one")

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
    def learned_width(self) -> int:
        """How many coordinates of the residual stream the blocks and the learned embeddings write."""
        return self.subspace or self.d_model

    def num_parameters(self, num_stages: int = 1) -> int:
        """Parameters of the whole model (all stages together) when cut into `num_stages` stages.

        The count depends on `num_stages` only with a bottleneck: each of the num_stages - 1
        boundaries holds one down and one up projection.
        """
        d, w, m = self.d_model, self.learned_width, self.mlp_ratio
        # qkv, then the two projections that write the residual stream (w wide), then norms
        per_block = (3 + m) * d * d + (1 + m) * d * w + (7 + m) * d + 2 * w
        embeddings = self.vocab_size * w + self.seq_len * w
        head = 2 * d + d * self.vocab_size + self.vocab_size
        b = self.bottleneck
        per_boundary = (d * b + b) + (b * d + d) if b else 0
        return embeddings + self.n_layer * per_block + head + (num_stages - 1) * per_boundary


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
    )
}


def get_model_spec(name: str, **overrides: int) -> ModelSpec:
    """The registered spec called `name`, optionally with some fields replaced."""
    try:
        spec = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None
    return replace(spec, **overrides) if overrides else spec
