"""Prompt datasets (`data prepare --format prompts`): what an RL run (train.objective grpo) generates from.

A record is `{"prompt": str}` (one user turn) or `{"messages": [{"role", "content"}, ...]}` whose last turn (after
any system turns) is the user's, with an optional `"answer": str` the reward functions compare completions with.
Each prompt is stored as its token ids up to the opening of the assistant's turn, rendered as generation renders it
(chat.encode_prompt: the tokenizer's chat_template with add_generation_prompt, else DeepSeek-V3's format); each
shard's record (layout.py) holds the prompts' rendered texts and answers beside its counts, their hash in meta.json.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .errors import DataError
from .layout import (
    PROMPTS_FORMAT,
    check_shard_checksums,
    check_shard_sizes,
    dataset_format,
    read_json,
    read_meta,
    shard_files,
)


def prompt_record(record) -> tuple[list, str | None]:
    """(the raw `messages` of a prompt record, its answer or None); ValueError saying what is wrong (chat.py checks
    the turns and prefixes the line's file:line)."""
    if not isinstance(record, dict):
        raise ValueError(f"a {type(record).__name__}, not a prompt object {{\"prompt\"}} or {{\"messages\"}}")
    keys = [k for k in ("prompt", "messages") if record.get(k) is not None]
    if len(keys) != 1:
        raise ValueError("a prompt record needs exactly one of 'prompt' (a string) and 'messages' (chat turns, the "
                         f"last one the user's) (keys: {', '.join(sorted(record)) or 'none'})")
    answer = record.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise ValueError(f"'answer' must be a string, got {type(answer).__name__}: write it as a string, e.g. "
                         f"\"{answer}\"")
    if keys == ["prompt"]:
        if not isinstance(record["prompt"], str):
            raise ValueError("'prompt' must be a string (or use 'messages' for chat turns)")
        return [{"role": "user", "content": record["prompt"]}], answer
    return record["messages"], answer


def extras_sha256(texts: list[str], answers: list[str | None]) -> str:
    """The hash meta.json keeps of a shard's prompt texts and answers (its record holds them)."""
    return hashlib.sha256(json.dumps([texts, answers], ensure_ascii=False).encode()).hexdigest()


class PromptDataset:
    """One split of a prompts dataset: prompt i's token ids, its rendered text and its answer. Shard sizes are
    checked on open, each shard's checksums (token ids, texts, answers) on its first read; ids are memory-mapped."""

    def __init__(self, data_dir: str, split: str = "train", *, verify_checksums: bool = True):
        meta = read_meta(data_dir)
        if dataset_format(meta) != PROMPTS_FORMAT:
            raise DataError(f"{data_dir} is a {dataset_format(meta)} dataset, not a prompts dataset: prepare one with "
                            "`deepseek-ds data prepare --format prompts`")
        if split not in meta["splits"]:
            raise DataError(f"{data_dir} has no split {split!r} (splits: {', '.join(meta['splits'])})")
        self.dataset_dir, self.split, self._dtype = str(data_dir), split, meta["dtype"]
        root = Path(data_dir)
        self._records = [s for s in meta["splits"][split]["shards"] if s["num_docs"] > 0]
        for record in self._records:
            check_shard_sizes(root, record, self._dtype)
        self._bounds = [np.fromfile(shard_files(root, r["name"])[1], dtype="<i8") for r in self._records]
        counts = [len(b) - 1 for b in self._bounds]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # each shard's first prompt
        self._verify = verify_checksums
        self._loaded: dict[int, tuple[np.memmap, list[str], list[str | None]]] = {}

    def __len__(self) -> int:
        return int(self._first[-1])

    def longest(self) -> int:
        """The most tokens of any prompt (0 without prompts), from the shards' offsets alone."""
        return max((int(np.diff(b).max()) for b in self._bounds if len(b) > 1), default=0)

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self._first, i, side="right")) - 1
        return k, i - int(self._first[k])

    def _shard(self, k: int) -> tuple[np.memmap, list[str], list[str | None]]:
        if k not in self._loaded:
            root, record = Path(self.dataset_dir), self._records[k]
            bin_path, _, record_path = shard_files(root, record["name"])
            written = read_json(record_path)
            if self._verify:
                check_shard_checksums(root, record)
                if extras_sha256(written["texts"], written["answers"]) != record["prompts_sha256"]:
                    raise DataError(f"{record_path} does not match its prompts' sha256 checksum in meta.json "
                                    f"(corrupted): delete {self.dataset_dir} and prepare it again")
            self._loaded[k] = (np.memmap(bin_path, dtype=self._dtype, mode="r"), written["texts"], written["answers"])
        return self._loaded[k]

    def prompt_ids(self, i: int) -> list[int]:
        """Prompt i's token ids: the rendered conversation up to and including the opening of the assistant's turn."""
        k, j = self._locate(i)
        return self._shard(k)[0][self._bounds[k][j]:self._bounds[k][j + 1]].astype(np.int64).tolist()

    def prompt_text(self, i: int) -> str:
        """Prompt i as rendered text (its ids decoded with the special tokens kept): what reward functions get."""
        k, j = self._locate(i)
        return self._shard(k)[1][j]

    def answer(self, i: int) -> str | None:
        k, j = self._locate(i)
        return self._shard(k)[2][j]

    def __getitem__(self, i: int) -> dict:
        """Prompt i as `data dump` prints it."""
        return {"prompt_ids": self.prompt_ids(i), "prompt_text": self.prompt_text(i), "answer": self.answer(i)}

    def report(self) -> str:
        return f"prompts ({self.split}): {len(self):,} prompts"
