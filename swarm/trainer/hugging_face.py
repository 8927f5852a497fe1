"""Hugging Face datasets and tokenizers as training data (the optional `hf` extra).

`--data hf:NAME_OR_PATH` reads the text column of a dataset: a folder saved with
`Dataset.save_to_disk`, a local data file (.json, .jsonl, .csv, .parquet, or anything else as
lines of text), a local folder of such files, or a dataset name on the hub (`hf:NAME[:CONFIG]`,
which needs the network or the local cache). `--tokenizer` loads a `tokenizer.json` file, a folder
holding one, or a tokenizer name on the hub.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from swarm.trainer.data_source import HF_PREFIX, CorpusError

logger = logging.getLogger(__name__)

INSTALL_HINT = "install the optional Hugging Face packages with: pip install -e '.[hf]'"
# tokens that tokenizers commonly reserve to end a document; the first one a tokenizer knows separates ours
END_OF_DOCUMENT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|end_of_text|>")
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"--data {HF_PREFIX}... needs the datasets package; {INSTALL_HINT}") from None
    datasets.disable_progress_bars()
    return datasets


def _load(source: str, split: str) -> Any:
    """The dataset (or dict of splits) that `source` names; CorpusError with the reason if it cannot be loaded."""
    datasets = _import_datasets()
    path = Path(source)
    try:
        if path.is_dir() and any((path / name).is_file() for name in ("dataset_dict.json", "dataset_info.json")):
            return datasets.load_from_disk(str(path))
        if path.is_file():
            builder = DATA_FILE_BUILDERS.get(path.suffix.lower(), "text")
            return datasets.load_dataset(builder, data_files=str(path), split=split)
        if path.is_dir():
            return datasets.load_dataset(str(path), split=split)
        name, _, config = source.partition(":")
        return datasets.load_dataset(name, config or None, split=split)
    except (CorpusError, KeyboardInterrupt):
        raise
    except Exception as e:  # datasets raises many kinds: missing files, offline hub, unknown splits, bad files
        raise CorpusError(f"--data {HF_PREFIX}{source}: cannot load the dataset ({type(e).__name__}: {e})") from None


def dataset_documents(source: str, split: str = "train", column: str = "text") -> Iterator[bytes]:
    """The `column` of every row of dataset `source` (its `split`), as UTF-8 bytes; empty rows skipped."""
    dataset = _load(source, split)
    if isinstance(dataset, _import_datasets().DatasetDict):  # a saved dict of splits
        if split not in dataset:
            raise CorpusError(
                f"--data {HF_PREFIX}{source} has no split {split!r}; its splits: {', '.join(dataset)} (--data-split)"
            )
        dataset = dataset[split]
    if column not in dataset.column_names:
        raise CorpusError(
            f"--data {HF_PREFIX}{source} has no column {column!r}; its columns: {', '.join(dataset.column_names)} "
            "(--text-column)"
        )
    logger.info(f"Reading column {column!r} of {len(dataset)} rows of {source} ({split})")
    for rows in dataset.select_columns([column]).iter(batch_size=1000):
        for text in rows[column]:
            if not isinstance(text, str):
                raise CorpusError(
                    f"--data {HF_PREFIX}{source}: column {column!r} holds {type(text).__name__}, not text"
                )
            if text:
                yield text.encode("utf-8")


class TextTokenizer:
    """A `tokenizers` tokenizer and the id that ends each document.

    The separator is the tokenizer's own end-of-document token if it has one of the usual names,
    else one more id past its vocabulary; `vocab_size` counts every id it can produce.
    """

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        known = [tokenizer.token_to_id(token) for token in END_OF_DOCUMENT_NAMES]
        known = [i for i in known if i is not None]
        self.end_of_document = known[0] if known else size
        self.vocab_size = max(size, self.end_of_document + 1)

    def encode_documents(self, texts: list[str]) -> list[torch.Tensor]:
        """Each text's ids followed by the end-of-document id, as int32 tensors."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [torch.tensor([*encoding.ids, self.end_of_document], dtype=torch.int32) for encoding in encodings]


def load_tokenizer(name_or_path: str) -> TextTokenizer:
    """The tokenizer in a tokenizer.json file, a folder holding one, or on the hub by name."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CorpusError(f"--tokenizer needs the tokenizers package; {INSTALL_HINT}") from None
    path = Path(name_or_path)
    try:
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise CorpusError(f"--tokenizer {name_or_path}: the folder holds no tokenizer.json")
            return TextTokenizer(Tokenizer.from_file(str(path / "tokenizer.json")), name_or_path)
        if path.is_file():
            return TextTokenizer(Tokenizer.from_file(str(path)), name_or_path)
        return TextTokenizer(Tokenizer.from_pretrained(name_or_path), name_or_path)
    except CorpusError:
        raise
    except Exception as e:  # a file that is no tokenizer, an unknown name, no network to the hub
        raise CorpusError(f"--tokenizer {name_or_path}: cannot load it ({type(e).__name__}: {e})") from None
