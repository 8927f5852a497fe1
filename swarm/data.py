"""Training data: a corpus of bytes and the batches drawn from it.

The default corpus is the Python standard library's own source, present on every machine. Each
step's global batch depends only on (seed, step), so a swarm and a one-process reference see the
same samples, and a restarted trainer continues the same sequence.
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

import torch

from swarm.models import EOD_TOKEN

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".cfg", ".toml", ".yaml", ".yml", ".html"}


def default_corpus_files() -> list[Path]:
    """The standard library's .py files, in a fixed order, without installed third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def corpus_files(path: str | None) -> list[Path]:
    """The files of a corpus: the default one, a single file, or every text file under a folder."""
    if path is None:
        return default_corpus_files()
    root = Path(path)
    if root.is_file():
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"--data {path}: no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under it")
        return files
    raise ValueError(f"--data {path}: no such file or folder")


class ByteCorpus:
    """Files read as bytes into one token tensor, documents separated by the end-of-document token."""

    def __init__(self, path: str | None = None, max_bytes: int = 32 * 2**20) -> None:
        chunks, total = [], 0
        for file in corpus_files(path):
            try:
                data = file.read_bytes()
            except OSError as e:
                logger.warning(f"Skipping unreadable corpus file {file}: {e}")
                continue
            data = data[: max_bytes - total]
            chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16) if data else None)
            chunks.append(torch.tensor([EOD_TOKEN], dtype=torch.int16))
            total += len(data) + 1
            if total >= max_bytes:
                break
        self.tokens = torch.cat([chunk for chunk in chunks if chunk is not None])
        if len(self.tokens) < 2:
            raise ValueError(f"corpus {path or 'stdlib'} is empty")

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
        """The global batch of `step`: int64 [batch_size, seq_len + 1] windows (inputs and next tokens)."""
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(self.tokens)} tokens is too short for sequences of {seq_len}")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len + 1)
        return self.tokens[starts[:, None] + offsets].long()
