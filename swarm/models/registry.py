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
    """

    name: str
    seq_len: int
    d_model: int
    n_layer: int
    n_head: int
    vocab_size: int = BYTE_VOCAB_SIZE
    mlp_ratio: int = 4
    bottleneck: int = 0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"{self.name}: d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.bottleneck < 0:
            raise ValueError(f"{self.name}: bottleneck must be 0 (off) or positive, got {self.bottleneck}")

    @property
    def boundary_width(self) -> int:
        """Width of the hidden states passed between stages: [batch, seq, boundary_width] on the wire."""
        return self.bottleneck or self.d_model

    def num_parameters(self, num_stages: int = 1) -> int:
        """Parameters of the whole model (all stages together) when cut into `num_stages` stages.

        The count depends on `num_stages` only with a bottleneck: each of the num_stages - 1
        boundaries holds one down and one up projection.
        """
        d = self.d_model
        per_block = 4 * d * d + 2 * self.mlp_ratio * d * d + (9 + self.mlp_ratio) * d  # weights; biases, norms
        embeddings = self.vocab_size * d + self.seq_len * d
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
