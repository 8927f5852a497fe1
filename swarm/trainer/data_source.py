"""What `--data` may name, as both readers of it know it: files (`swarm.trainer.data`) and Hugging Face datasets
(`swarm.trainer.hugging_face`), and the error either raises for data it cannot use."""

from __future__ import annotations

HF_PREFIX = "hf:"  # --data hf:NAME_OR_PATH: a Hugging Face dataset


class CorpusError(ValueError):
    """The data cannot be used: nothing there, nothing readable, or not text."""
