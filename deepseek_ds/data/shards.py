"""One shard = a fixed run of documents, tokenized into .bin/.idx files by whichever worker gets it.

A shard's bytes depend only on its documents and the tokenizer, never on the worker count or on
scheduling, which is what makes the output byte-identical for any number of workers.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..utils.fs import write_bytes_atomic, write_json_atomic
from .chat import encode, encode_prompt
from .errors import DataError
from .formats import AUTO
from .layout import PREFERENCE_FORMAT as PREFERENCE
from .layout import PROMPTS_FORMAT as PROMPTS
from .layout import TOKENIZER_DIR, check_shard, mask_file, read_json, shard_files
from .prompts import extras_sha256
from .sources import DocTable, read_conversation_rows, read_docs

# Documents per encode_batch call: bounds worker memory on shards of many small documents.
_ENCODE_BATCH = 512


@dataclass(frozen=True)
class ShardTask:
    name: str  # e.g. "train-00003"
    out_dir: str
    docs: DocTable
    field: str
    tokenizer_json: str  # the exact `tokenizers` pipeline (see tokenizer.backend_json)
    eos_id: int
    dtype: str
    key: str  # hash of everything the shard's bytes depend on
    train_on: str | None = None  # chat datasets: which assistant turns are trained (chat.TRAIN_ON); None: text
    line_format: str = AUTO  # chat datasets: the records' format (formats.LINE_FORMATS)


def shard_key(docs: DocTable, field: str, tok_hash: str, eos_id: int, dtype: str, chat: list | None = None) -> str:
    """`chat`: for chat shards, everything else their bytes depend on (train_on, the chat_template, special ids)."""
    desc = [tok_hash, field, eos_id, dtype, docs.refs()] + ([chat] if chat is not None else [])
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()


def group_by_size(sizes: np.ndarray, shard_bytes: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges: a document goes to the shard its first byte falls in."""
    if len(sizes) == 0:
        return []
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) // max(1, shard_bytes)
    cuts = [0, *(np.flatnonzero(np.diff(starts)) + 1).tolist(), len(sizes)]
    return list(zip(cuts[:-1], cuts[1:]))


def written_record(task: ShardTask) -> dict | None:
    """The record of the shard as written for exactly this task (its files were published before it), or None."""
    record_path = shard_files(Path(task.out_dir), task.name)[2]
    if not record_path.is_file():
        return None
    record = read_json(record_path)
    return record if record.get("key") == task.key else None


def remove_dead_temporaries(tasks: list[ShardTask], before: float) -> None:
    """A writer killed mid-file (a host that died, a killed run) leaves the temporary of a shard file beside it
    (utils.fs: `.{file}.{random}.tmp`), and the shard has been written again since. Called once every shard is done:
    the shard files' temporaries older than `before` (this run's plan) go; a racing run's lives for one write."""
    for out in {Path(t.out_dir) for t in tasks}:
        names = {p.name for t in tasks for p in (*shard_files(out, t.name), mask_file(out, t.name))}
        for path in out.glob(".*.tmp"):
            if path.name[1:].rsplit(".", 2)[0] in names and path.is_file() and path.stat().st_mtime < before:
                path.unlink(missing_ok=True)


def is_done(task: ShardTask) -> bool:
    """True when the shard was completely written for exactly this task and is intact on disk."""
    record = written_record(task)
    if record is None:
        return False
    try:
        check_shard(Path(task.out_dir), record, task.dtype, verify_checksums=True)
    except DataError:
        return False  # damaged: the caller rebuilds it
    return True


@lru_cache(maxsize=1)
def _backend(tokenizer_json: str) -> Tokenizer:
    # One per process, not per shard: parsing costs ~20 ms a shard, and the BPE's word cache stays warm across a
    # worker's shards as it does in one batch encode over the whole corpus (the raw rate `bench data` compares to).
    return Tokenizer.from_str(tokenizer_json)


def _tokenize(task: ShardTask, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    tok = _backend(task.tokenizer_json)
    pieces, lengths = [], []
    for b in range(0, len(texts), _ENCODE_BATCH):
        flat: list[int] = []  # this call's documents, each followed by EOS: one conversion to numpy per call
        # encode_batch_fast: encode_batch's ids without the character offsets we never read (~25% fewer
        # instructions). `enc.ids` builds a new list at each access, hence one read per document.
        for ids in (enc.ids for enc in tok.encode_batch_fast(texts[b:b + _ENCODE_BATCH], add_special_tokens=False)):
            if ids:  # an empty document adds nothing, not even an EOS
                flat += ids
                flat.append(task.eos_id)
                lengths.append(len(ids) + 1)
        pieces.append(np.fromiter(flat, task.dtype, len(flat)))
    tokens = np.concatenate(pieces) if pieces else np.empty(0, task.dtype)
    return tokens, np.cumsum([0, *lengths], dtype=np.int64)


@lru_cache(maxsize=1)
def _dataset_tokenizer(out_dir: str):
    from .tokenizer import load_hf_tokenizer  # transformers: only chat shards need it

    return load_hf_tokenizer(Path(out_dir) / TOKENIZER_DIR)


def _encode_chat(task: ShardTask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, sample bounds, trained mask) of the shard's conversations, rendered by chat.encode."""
    tok = _dataset_tokenizer(task.out_dir)
    rows = read_conversation_rows(task.docs, task.line_format)
    if task.line_format == PREFERENCE:  # a pair's chosen, then its rejected conversation: trained on the response
        encoded = [encode(tok, messages, "last") for pair in rows for messages in pair]
    else:
        encoded = [encode(tok, messages, task.train_on) for messages in rows]
    tokens = np.array([i for e in encoded for i in e.ids], task.dtype)
    mask = np.array([t for e in encoded for t in e.trained], np.uint8)
    bounds = np.concatenate([[0], np.cumsum([len(e.ids) for e in encoded])]).astype(np.int64)
    return tokens, bounds, mask


def _encode_prompts(task: ShardTask) -> tuple[np.ndarray, np.ndarray, dict]:
    """(tokens, sample bounds, the record's prompt texts and answers) of a prompts shard: each prompt rendered up to
    the opening of the assistant's turn (chat.encode_prompt, as generation renders it)."""
    tok = _dataset_tokenizer(task.out_dir)
    rows = read_conversation_rows(task.docs, PROMPTS)
    encoded = [encode_prompt(tok, messages) for messages, _ in rows]
    tokens = np.array([i for ids in encoded for i in ids], task.dtype)
    bounds = np.concatenate([[0], np.cumsum([len(ids) for ids in encoded])]).astype(np.int64)
    # The text the ids decode to, special tokens kept: what a reward function is shown as the prompt.
    texts = [tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) for ids in encoded]
    answers = [answer for _, answer in rows]
    return tokens, bounds, {"texts": texts, "answers": answers, "prompts_sha256": extras_sha256(texts, answers)}


def write_shard(task: ShardTask) -> dict:
    """Tokenize one shard and publish its .bin, .idx (, .mask) and then its record. Returns the record."""
    extras: dict = {}
    mask = None
    if task.train_on is None:
        tokens, bounds = _tokenize(task, read_docs(task.docs, task.field))
    elif task.line_format == PROMPTS:
        tokens, bounds, extras = _encode_prompts(task)
    else:
        tokens, bounds, mask = _encode_chat(task)
    bin_path, idx_path, record_path = shard_files(Path(task.out_dir), task.name)
    token_bytes, bound_bytes = tokens.astype(f"<{tokens.dtype.str[1:]}").tobytes(), bounds.astype("<i8").tobytes()
    write_bytes_atomic(bin_path, token_bytes)
    write_bytes_atomic(idx_path, bound_bytes)
    record = {"name": task.name, "key": task.key, "num_docs": len(bounds) - 1, "num_tokens": len(tokens),
              "bin_sha256": hashlib.sha256(token_bytes).hexdigest(),
              "idx_sha256": hashlib.sha256(bound_bytes).hexdigest()}
    if mask is not None:
        mask_bytes = mask.tobytes()
        write_bytes_atomic(mask_file(Path(task.out_dir), task.name), mask_bytes)
        record["mask_sha256"] = hashlib.sha256(mask_bytes).hexdigest()
    if task.line_format == PREFERENCE:
        record["identical_pairs"] = identical_pairs(tokens, bounds)
    record.update(extras)
    write_json_atomic(record_path, record)
    return record


def identical_pairs(tokens: np.ndarray, bounds: np.ndarray) -> int:
    """Pairs (samples 2k, 2k + 1) whose chosen and rejected conversations are the same tokens: no preference."""
    return sum(np.array_equal(tokens[bounds[k]:bounds[k + 1]], tokens[bounds[k + 1]:bounds[k + 2]])
               for k in range(0, len(bounds) - 2, 2))


def init_worker() -> None:
    # One thread per worker process: `workers` then means cores, and rayon pools do not oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
