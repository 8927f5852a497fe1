"""Training data: a corpus of tokens and the batches drawn from it.

The default corpus is the Python standard library's own source, present on every machine, read
as bytes (256 symbols plus the end-of-document token). `--data` names a text file, a folder of
them (recognised by content, not by name), or a Hugging Face dataset (`hf:NAME_OR_PATH`, with the
optional `hf` extra); `--tokenizer` replaces bytes with a tokenizer's ids. Each step's global batch
depends only on (seed, step), so a swarm and a one-process reference see the same samples, and a
restarted trainer continues the same sequence.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from swarm.models import BYTE_VOCAB_SIZE, EOD_TOKEN
from swarm.trainer.data_source import HF_PREFIX, CorpusError

logger = logging.getLogger(__name__)

HEAD_BYTES = 8192  # how much of a file is read to tell text from binary
MIN_PRINTABLE = 0.95  # share of printable bytes that makes a head that is not UTF-8 count as text (Latin-1 etc.)
TOKENIZE_BATCH = 256  # documents per call to a tokenizer


def default_corpus_files() -> list[Path]:
    """The standard library's .py files, in a fixed order, without installed third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def looks_like_text(head: bytes) -> bool:
    """Whether the first bytes of a file are text: no NUL byte, and UTF-8 or almost all printable.

    A head cut off inside a multi-byte UTF-8 character still counts as UTF-8.
    """
    if not head:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        # only the last character cut by the head's end: the rest decoded
        if e.start >= len(head) - 3 and e.reason == "unexpected end of data":
            return True
    printable = sum(32 <= b < 127 or b in (9, 10, 12, 13) or b >= 160 for b in head)
    return printable >= MIN_PRINTABLE * len(head)


def _walk_files(root: Path) -> Iterator[Path]:
    """Every file under `root` in a fixed order, following folder links once each (a link loop ends there)."""
    seen: set[str] = set()
    stack = [root]
    while stack:
        folder = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:
            logger.warning(f"Skipping {folder}: a link back to a folder already read")
            continue
        seen.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError as e:
            logger.warning(f"Skipping unreadable folder {folder}: {e}")
            continue
        folders = []
        for entry in entries:
            path = Path(entry.path)
            try:
                is_folder = entry.is_dir()
            except OSError:  # a link loop or a dangling link: read as a file below, which says why
                is_folder = False
            if is_folder:
                folders.append(path)
            else:
                yield path
        stack.extend(reversed(folders))  # depth first, in name order


def text_files_under(root: Path) -> list[Path]:
    """The text files under folder `root`, by content; binaries and unreadable files are skipped with a warning."""
    files, skipped = [], 0
    for path in _walk_files(root):
        try:
            with open(path, "rb") as file:
                head = file.read(HEAD_BYTES)
        except OSError as e:
            logger.warning(f"Skipping unreadable file {path}: {e.strerror or e}")
            skipped += 1
            continue
        if looks_like_text(head):
            files.append(path)
        elif head:
            logger.info(f"Skipping {path}: not text")
            skipped += 1
    if skipped:
        logger.warning(f"--data {root}: skipped {skipped} binary or unreadable files; reading {len(files)} text files")
    return files


def corpus_files(path: str | None) -> list[Path]:
    """The files of a corpus: the default one, a single file, or every text file under a folder."""
    if path is None:
        return default_corpus_files()
    root = Path(path)
    if root.is_dir():
        if (root / "dataset_info.json").is_file() or (root / "dataset_dict.json").is_file():
            raise CorpusError(f"--data {path} is a saved Hugging Face dataset; give it as --data {HF_PREFIX}{path}")
        files = text_files_under(root)
        if not files:
            raise CorpusError(
                f"--data {path}: no text files under it (files are read as text when they hold no NUL byte "
                "and are UTF-8 or mostly printable)"
            )
        return files
    if root.exists():
        return [root]
    raise CorpusError(f"--data {path}: no such file or folder")


def file_documents(path: str | None) -> Iterator[bytes]:
    """The contents of the corpus files, unreadable ones skipped with a warning."""
    for file in corpus_files(path):
        try:
            yield file.read_bytes()
        except OSError as e:
            logger.warning(f"Skipping unreadable corpus file {file}: {e}")


class Corpus:
    """Documents as one token tensor, separated by an end-of-document token; batches drawn from it."""

    def __init__(self, tokens: torch.Tensor, vocab_size: int, name: str) -> None:
        self.tokens = tokens
        self.vocab_size = vocab_size  # a model needs at least this many ids to train on it
        self.name = name
        if len(self.tokens) < 2:
            raise CorpusError(f"corpus {name} is empty")

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
        """The global batch of `step`: int64 [batch_size, seq_len + 1] windows (inputs and next tokens)."""
        if len(self.tokens) <= seq_len + 1:
            raise CorpusError(f"corpus of {len(self.tokens)} tokens is too short for sequences of {seq_len}")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len + 1)
        return self.tokens[starts[:, None] + offsets].long()


def _capped(documents: Iterable[bytes], max_bytes: int) -> Iterator[bytes]:
    """The documents, cut so that together with one separator each they hold at most `max_bytes`."""
    total = 0
    for data in documents:
        data = data[: max(0, max_bytes - total)]
        yield data
        total += len(data) + 1
        if total >= max_bytes:
            return


def byte_tokens(documents: Iterable[bytes], max_bytes: int) -> torch.Tensor:
    """Documents as bytes, each followed by EOD_TOKEN (int16: the byte vocabulary fits)."""
    chunks = []
    for data in _capped(documents, max_bytes):
        if data:
            chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        chunks.append(torch.tensor([EOD_TOKEN], dtype=torch.int16))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int16)


class ByteCorpus(Corpus):
    """Files read as bytes into one token tensor, documents separated by the end-of-document token."""

    def __init__(self, path: str | None = None, max_bytes: int = 32 * 2**20) -> None:
        super().__init__(byte_tokens(file_documents(path), max_bytes), BYTE_VOCAB_SIZE, path or "stdlib")


def load_corpus(
    data: str | None,
    max_bytes: int = 32 * 2**20,
    tokenizer: str | None = None,
    split: str = "train",
    text_column: str = "text",
) -> Corpus:
    """The corpus `--data` names (files, a folder or hf:NAME_OR_PATH), as bytes or with `tokenizer`.

    Raises CorpusError with a message for the user when the data or the tokenizer cannot be used.
    """
    if data is not None and data.startswith(HF_PREFIX):
        from swarm.trainer.hugging_face import dataset_documents

        documents: Iterable[bytes] = dataset_documents(data[len(HF_PREFIX) :], split, text_column)
    else:
        documents = file_documents(data)
    name = data or "stdlib"
    if tokenizer is None:
        return Corpus(byte_tokens(documents, max_bytes), BYTE_VOCAB_SIZE, name)
    from swarm.trainer.hugging_face import load_tokenizer

    text_tokenizer = load_tokenizer(tokenizer)
    chunks, batch = [], []
    for data_bytes in _capped(documents, max_bytes):
        batch.append(data_bytes.decode("utf-8", errors="replace"))
        if len(batch) == TOKENIZE_BATCH:
            chunks += text_tokenizer.encode_documents(batch)
            batch = []
    if batch:
        chunks += text_tokenizer.encode_documents(batch)
    tokens = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int32)
    return Corpus(tokens, text_tokenizer.vocab_size, f"{name} ({tokenizer})")
