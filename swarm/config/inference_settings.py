"""The settings of `swarm generate` and `swarm eval`: read the model through the live swarm while it trains."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config.options import ConfigError, option
from swarm.config.shared import ModelConfig, NetworkConfig


@dataclass
class InferenceConfig(NetworkConfig, ModelConfig):
    """What reading the model through the swarm takes: its DHT, its model and cut, and how calls are retried."""

    call_timeout: float = option(60.0, "seconds one call to a peer may take before another peer of its stage is tried")
    max_retries: int = option(5, "attempts per stage call (on different peers where the stage has them)")
    swarm_wait: float = option(60.0, "seconds to wait for every stage to have a serving peer")
    tokenizer: str | None = option(
        None, "a tokenizer.json file, a folder holding one, or a hub name, as the trainers use; default: bytes"
    )
    output_file: str | None = option(None, "write what was read (tokens or losses, steps, replays) as JSON to FILE")

    def check(self) -> None:
        NetworkConfig.check(self)
        ModelConfig.check(self)
        if self.call_timeout <= 0 or self.swarm_wait <= 0:
            raise ConfigError("--call-timeout and --swarm-wait must be positive")
        if self.max_retries < 1:
            raise ConfigError("--max-retries must be at least 1")


@dataclass
class GenerateConfig(InferenceConfig):
    """`swarm generate`: continue a prompt with the swarm's live weights, a token at a time."""

    prompt: str = option("", "the text to continue (empty: start from the end-of-document token)")
    max_new_tokens: int = option(32, "tokens to generate (prompt and new tokens together fit the model's context)")
    temperature: float = option(0.0, "0: greedy (the likeliest token); above 0: sample at this temperature")
    top_k: int = option(0, "when sampling, only from the k likeliest tokens (0: from all)")
    sample_seed: int = option(0, "seed of the sampling")

    def check(self) -> None:
        InferenceConfig.check(self)
        if self.max_new_tokens < 1 or self.temperature < 0 or self.top_k < 0:
            raise ConfigError("--max-new-tokens must be at least 1, --temperature and --top-k 0 or more")


@dataclass
class EvalConfig(InferenceConfig):
    """`swarm eval`: the held-out loss of the model as the swarm holds it now."""

    data: str | None = option(
        None, "held-out text to score: a file or a folder of text files (default: Python's standard library)"
    )
    samples: int = option(64, "sequences to score, drawn from the data")
    batch_size: int = option(8, "sequences per call")
    data_seed: int = option(1_000_003, "which windows of the data to score (another than the trainers' seed)")
    max_corpus_mb: float = option(32.0, "read at most this many MiB of the data")

    def check(self) -> None:
        InferenceConfig.check(self)
        if self.samples < 1 or self.batch_size < 1 or self.max_corpus_mb <= 0:
            raise ConfigError("--samples and --batch-size must be at least 1, --max-corpus-mb positive")
        from swarm.config.roles import check_data_path

        check_data_path(self.data)
