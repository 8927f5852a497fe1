"""Training data: folders of text recognised by content, Hugging Face datasets and tokenizers, real runs on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.models import BYTE_VOCAB_SIZE
from swarm.trainer.data import ByteCorpus, CorpusError, corpus_files, load_corpus, looks_like_text

LICENCE = """Permission is hereby granted, free of charge, to any person obtaining a copy of this software
and associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense,
and/or sell copies of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND.
"""
# offline: nothing in these tests may reach the hub. Set before datasets is imported, which reads them once.
HF_OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
os.environ.update(HF_OFFLINE)


def swarm_command(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **HF_OFFLINE},
    )


def licence_folder(root: Path) -> Path:
    """A folder like /usr/share/common-licenses: texts without suffixes, plus a binary and broken links."""
    root.mkdir()
    (root / "MIT").write_text(LICENCE)
    (root / "Apache-2.0").write_text(LICENCE.replace("Software", "Work") * 3)
    (root / "nested").mkdir()
    (root / "nested" / "ISC").write_text("Copyright © 2024 Zoë Müller\n" + LICENCE)  # UTF-8
    (root / "nested" / "Latin1").write_bytes("Droits réservés, Société Générale\n".encode("latin-1") * 20)
    (root / "logo").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8)
    (root / "empty").write_bytes(b"")
    os.symlink(root / "missing", root / "dangling")
    os.symlink(root / "loop-b", root / "loop-a")
    os.symlink(root / "loop-a", root / "loop-b")
    os.symlink(root, root / "nested" / "back-to-root")  # a folder link loop: read once
    return root


def test_a_folder_of_text_is_recognised_by_content_not_suffix(tmp_path, caplog):
    folder = licence_folder(tmp_path / "licenses")
    files = corpus_files(str(folder))
    assert [f.relative_to(folder).as_posix() for f in files] == ["Apache-2.0", "MIT", "nested/ISC", "nested/Latin1"]
    assert "dangling" in caplog.text and "loop-a" in caplog.text and "back-to-root" in caplog.text
    corpus = ByteCorpus(str(folder))
    expected = sum(len(f.read_bytes()) + 1 for f in files)  # every byte, and one separator per document
    assert len(corpus) == expected and corpus.vocab_size == BYTE_VOCAB_SIZE
    assert corpus.batch(0, 4, 64).shape == (4, 65)


def test_text_detection():
    assert looks_like_text(LICENCE.encode())
    assert looks_like_text("é".encode() * 10 + "€".encode()[:2])  # a head cut inside a multi-byte character
    assert looks_like_text("Société".encode("latin-1") * 50)  # not UTF-8, but printable
    assert not looks_like_text(b"text\0with a NUL")
    assert not looks_like_text(bytes(range(128, 160)) * 20)  # control bytes: no text in any common encoding
    assert not looks_like_text(b"")


def test_a_folder_without_text_is_one_clear_error(tmp_path):
    binaries = tmp_path / "binaries"
    binaries.mkdir()
    (binaries / "a.txt").write_bytes(b"\x00\x01\x02" * 100)  # the suffix says text, the content does not
    (binaries / "b").write_bytes(bytes(range(256)))
    with pytest.raises(CorpusError, match="no text files under it"):
        corpus_files(str(binaries))
    (tmp_path / "void").mkdir()
    result = swarm_command("train", "--data", str(tmp_path / "void"), "--steps", "1", "--no-progress")
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "no text files under it" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def make_hf_data(root: Path, vocab_size: int = 400) -> tuple[Path, Path]:
    """A small dataset saved to disk and a BPE tokenizer trained on it, both made here (nothing downloaded)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = LICENCE.split()
    texts = [" ".join(words[(i * 7) % len(words) :] + words[: (i * 7) % len(words)]) for i in range(300)]
    Dataset.from_dict({"body": texts, "id": list(range(len(texts)))}).save_to_disk(str(root / "dataset"))
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["[UNK]", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    return root / "dataset", root / "tokenizer.json"


def test_hugging_face_dataset_and_tokenizer(tmp_path):
    pytest.importorskip("datasets", reason="needs the hf extra: pip install -e '.[hf]'")
    dataset, tokenizer = make_hf_data(tmp_path)
    corpus = load_corpus(f"hf:{dataset}", text_column="body", tokenizer=str(tokenizer))
    assert BYTE_VOCAB_SIZE < corpus.vocab_size <= 400
    assert int(corpus.tokens.max()) < corpus.vocab_size
    assert corpus.batch(3, 2, 64).shape == (2, 65)
    as_bytes = load_corpus(f"hf:{dataset}", text_column="body")  # no tokenizer: UTF-8 bytes, as files are
    assert as_bytes.vocab_size == BYTE_VOCAB_SIZE and len(as_bytes) > len(corpus)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"row {i} " + LICENCE}) + "\n" for i in range(20)))
    assert len(load_corpus(f"hf:{jsonl}")) == sum(len(f"row {i} " + LICENCE) + 1 for i in range(20))
    with pytest.raises(CorpusError, match="no column 'text'; its columns: body, id"):
        load_corpus(f"hf:{dataset}")
    with pytest.raises(CorpusError, match="cannot load the dataset"):
        load_corpus("hf:no-such-dataset-anywhere")
    with pytest.raises(CorpusError, match="--tokenizer .*cannot load it"):
        load_corpus(f"hf:{dataset}", text_column="body", tokenizer=str(jsonl))


@pytest.mark.timeout(120)
def test_swarm_trains_on_a_hugging_face_dataset_with_a_tokenizer(local_swarm, tmp_path):
    pytest.importorskip("datasets", reason="needs the hf extra: pip install -e '.[hf]'")
    dataset, tokenizer = make_hf_data(tmp_path)
    vocab = load_corpus(f"hf:{dataset}", text_column="body", tokenizer=str(tokenizer)).vocab_size
    data_flags = ["--data", f"hf:{dataset}", "--text-column", "body", "--tokenizer", str(tokenizer)]
    model = ["--model", "gpt-tiny", "--num-stages", "2", "--seed", "3"]

    # the byte-level model cannot hold the tokenizer's ids: the trainer names the setting, before any peer is asked
    result = swarm_command("train", *model, *data_flags, "--steps", "1", "--no-progress")
    assert result.returncode == 1 and f"--vocab-size {vocab}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr

    local_swarm.env.update(HF_OFFLINE)
    local_swarm.start_bootstrap()
    for stage in range(2):
        local_swarm.start_peer(
            f"peer{stage}", stage, [*model, "--vocab-size", str(vocab), "--target-batch-size", "16", "--lr", "3e-3"]
        )
    summary_file = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer(
        "trainer",
        [*model, "--vocab-size", str(vocab), *data_flags, "--steps", "12", "--microbatch-size", "8"]
        + ["--summary-file", str(summary_file), "--no-progress", "--compression", "none"],
    )
    assert trainer.wait(100) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["steps"] == 12
    # a model of `vocab` ids starts near ln(vocab) and learns the repeated licence text quickly
    assert summary["first_loss"] > 5.0 and summary["last_loss"] < summary["first_loss"] - 1.0, summary["losses"]

    # a trainer whose vocabulary differs from the peers' is refused before it sends a token
    result = swarm_command(
        "train", *model, "--vocab-size", str(vocab + 10), *data_flags, "--steps", "1", "--no-progress",
        "--initial-peers", *local_swarm.initial_peers,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"--vocab-size {vocab} (you gave {vocab + 10})" in result.stderr, result.stderr


def test_missing_hf_extra_is_one_clear_line(tmp_path):
    # a Python that cannot import datasets or tokenizers, as without the extra
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "datasets.py").write_text("raise ImportError('blocked for the test')\n")
    (blocker / "tokenizers.py").write_text("raise ImportError('blocked for the test')\n")
    env = {**os.environ, **HF_OFFLINE, "PYTHONPATH": str(blocker)}
    result = subprocess.run(
        [sys.executable, "-m", "swarm", "train", "--data", "hf:anything", "--steps", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1 and "pip install -e '.[hf]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
