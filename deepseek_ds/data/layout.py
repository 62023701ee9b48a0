"""On-disk layout of a prepared dataset, its metadata, and the checks that run before training.

<dataset>/
  meta.json            written last (atomically): its presence means every file below is complete
  plan.json            what the dataset is built from; a re-run with other inputs is refused
  tokenizer/           AutoTokenizer directory the ids belong to
  {split}-NNNNN.bin    flat token ids (uint16 or uint32 by vocabulary), EOS after every document
  {split}-NNNNN.idx    int64 document boundaries within the shard (num_docs + 1 offsets, from 0)
  {split}-NNNNN.mask   chat datasets only: uint8 per token, 1 where the loss is computed (assistant content + EOS)
  {split}-NNNNN.json   the shard's record (counts, checksums), written after its .bin, .idx (and .mask)

A text dataset's .bin puts an EOS after every document; a chat dataset's .bin holds each rendered conversation as
it is (its own BOS, markers and EOS) and .idx bounds one sample (conversation) each. meta.json's "format" says which.
A preference dataset is a chat dataset whose samples come in pairs: 2k is pair k's chosen conversation, 2k + 1 its
rejected one, each trained on its response and EOS only; a shard always holds whole pairs.
A prompts dataset (RL: train.objective grpo) holds one rendered prompt per sample, up to the opening of the
assistant's turn, and no .mask; its shard records hold each prompt's text and answer (data/prompts.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError

FORMAT_VERSION = 1
META, PLAN, TOKENIZER_DIR = "meta.json", "plan.json", "tokenizer"
SPLITS = ("train", "valid")
TEXT_FORMAT, CHAT_FORMAT, PREFERENCE_FORMAT, PROMPTS_FORMAT = "text", "chat", "preference", "prompts"
FORMATS = (TEXT_FORMAT, CHAT_FORMAT, PREFERENCE_FORMAT, PROMPTS_FORMAT)
# Chat-like formats: one sample per .idx entry, not a token stream; chat and preference samples carry a trained mask
# (a preference dataset's samples 2k and 2k + 1 are pair k's chosen and rejected conversations, data/pairs.py), a
# prompts dataset's none (it is generated from, not trained on).
MASKED_FORMATS = (CHAT_FORMAT, PREFERENCE_FORMAT, PROMPTS_FORMAT)
TRAINED_FORMATS = (CHAT_FORMAT, PREFERENCE_FORMAT)


def shard_files(dataset_dir: Path, name: str) -> tuple[Path, Path, Path]:
    return dataset_dir / f"{name}.bin", dataset_dir / f"{name}.idx", dataset_dir / f"{name}.json"


def mask_file(dataset_dir: Path, name: str) -> Path:
    return dataset_dir / f"{name}.mask"


def dataset_format(meta: dict) -> str:
    # Datasets prepared before chat data existed have no "format" key, and they are all text.
    return meta.get("format", TEXT_FORMAT)


def file_sha256(path: Path) -> str:
    # Chunked reads through the page cache: hashing a huge shard does not grow the process RSS.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path} ({e}): re-run the same `deepseek-ds data prepare` command "
                        f"or delete {path.parent} and prepare it again") from e


def read_meta(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / META
    if not path.is_file():
        raise DataError(f"{dataset_dir} is not a prepared dataset (no {META}; an interrupted prepare leaves "
                        f"none): run `deepseek-ds data prepare --input ... --out {dataset_dir}` to build or finish it")
    meta = read_json(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path} has format version {meta.get('format_version')}, this code reads "
                        f"{FORMAT_VERSION}: prepare the dataset again with this version")
    return meta


def dataset_info(dataset_dir: str) -> dict:
    """Metadata of a prepared dataset: vocab_size, eos_id, dtype, num_tokens, num_docs (all splits),
    tokenizer_hash, and per-split counts and shard records under "splits"."""
    return read_meta(dataset_dir)


def check_shard(dataset_dir: Path, record: dict, dtype: str, verify_checksums: bool) -> None:
    """DataError when a shard's files are missing, truncated or corrupted relative to `record`."""
    check_shard_sizes(dataset_dir, record, dtype)
    if verify_checksums:
        check_shard_checksums(dataset_dir, record)


def check_shard_sizes(dataset_dir: Path, record: dict, dtype: str) -> None:
    """DataError when a shard's files are missing or not the size `record` says (cheap: two stat calls)."""
    bin_path, idx_path, _ = shard_files(dataset_dir, record["name"])
    expected = {bin_path: record["num_tokens"] * np.dtype(dtype).itemsize, idx_path: (record["num_docs"] + 1) * 8}
    if "mask_sha256" in record:
        expected[mask_file(dataset_dir, record["name"])] = record["num_tokens"]
    for path, size in expected.items():
        if not path.is_file():
            raise DataError(f"{path} is missing: {_rebuild_fix(dataset_dir)}")
        actual = path.stat().st_size
        if actual != size:
            raise DataError(f"{path} has {actual} bytes but {META} expects {size} (truncated or overwritten): "
                            f"{_rebuild_fix(dataset_dir)}")


def check_shard_checksums(dataset_dir: Path, record: dict) -> None:
    """DataError when a shard's bytes do not hash to `record`'s sha256 (reads the whole shard)."""
    bin_path, idx_path, _ = shard_files(dataset_dir, record["name"])
    checks = [(bin_path, record["bin_sha256"]), (idx_path, record["idx_sha256"])]
    if "mask_sha256" in record:
        checks.append((mask_file(dataset_dir, record["name"]), record["mask_sha256"]))
    for path, sha in checks:
        if file_sha256(path) != sha:
            raise DataError(f"{path} does not match its sha256 checksum in {META} (corrupted): "
                            f"{_rebuild_fix(dataset_dir)}")


def _rebuild_fix(dataset_dir: Path) -> str:
    return (f"re-run the same `deepseek-ds data prepare` command (it rebuilds damaged shards) or delete "
            f"{dataset_dir} and prepare it again")
