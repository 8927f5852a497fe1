"""Model specs by name: the presets a swarm can train."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Bytes 0..255 plus one special: the end-of-document separator placed between corpus files.
BYTE_VOCAB_SIZE = 257
EOD_TOKEN = 256


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style causal language model, described fully enough for every peer to build its stage."""

    name: str
    seq_len: int
    d_model: int
    n_layer: int
    n_head: int
    vocab_size: int = BYTE_VOCAB_SIZE
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"{self.name}: d_model {self.d_model} is not divisible by n_head {self.n_head}")

    def num_parameters(self) -> int:
        """Parameters of the whole model (all stages together)."""
        d = self.d_model
        per_block = 4 * d * d + 2 * self.mlp_ratio * d * d + (9 + 2 * self.mlp_ratio) * d
        embeddings = self.vocab_size * d + self.seq_len * d
        head = 2 * d + d * self.vocab_size + self.vocab_size
        return embeddings + self.n_layer * per_block + head


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # CPU demo and tests: trains visibly within a minute or two on 2 cores
        ModelSpec("gpt-tiny", seq_len=64, d_model=128, n_layer=6, n_head=4),
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
