"""`prepare_dataset`: inputs -> tokenizer -> parallel shards -> metadata, resumable and race-safe.

Every file is published atomically and meta.json comes last, so a killed or racing run never leaves a
dataset that looks complete; a re-run rebuilds only missing or damaged shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..utils.fs import publish_dir, temp_dir_for, write_json_atomic
from .chat import ASSISTANT_MARKER, TRAIN_ON, USER_MARKER, encode, encode_prompt
from .errors import DataError
from .formats import ALPACA, AUTO, INPUT_FORMATS, SHAREGPT
from .layout import (
    CHAT_FORMAT,
    FORMAT_VERSION,
    META,
    PLAN,
    PREFERENCE_FORMAT,
    PROMPTS_FORMAT,
    SPLITS,
    TEXT_FORMAT,
    TOKENIZER_DIR,
    read_json,
    shard_files,
)
from .shards import (
    ShardTask,
    group_by_size,
    init_worker,
    is_done,
    remove_dead_temporaries,
    shard_key,
    write_shard,
)
from .sources import (
    DEFAULT_EXTENSIONS,
    DocTable,
    read_conversation_rows,
    read_docs,
    scan_chat,
    scan_inputs,
    split_text_tail,
)
from .tokenizer import (
    backend_json,
    import_tokenizer,
    load_hf_tokenizer,
    resolve_tokenizer_dir,
    token_dtype,
    tokenizer_hash,
    train_bpe,
    vocab_size_of,
)

# Documents read at a time while streaming text into the BPE trainer.
_TRAIN_CHUNK = 1000


def split_rows(num_docs: int, valid_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Hold out whole documents for validation: a seeded choice, at least one when asked for any."""
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    n_valid = 0 if valid_fraction == 0 or num_docs < 2 else min(num_docs - 1, max(1, round(num_docs * valid_fraction)))
    valid = np.sort(np.random.default_rng(seed).choice(num_docs, n_valid, replace=False))
    train = np.setdiff1d(np.arange(num_docs), valid)
    return {"train": train, "valid": valid}


def _split(table: DocTable, valid_fraction: float, seed: int) -> tuple[DocTable, dict[str, np.ndarray]]:
    """Whole documents held out; a single text document is held out by its tail instead (split_text_tail). One
    document that cannot be cut leaves the validation split empty: the summary says so and validate() refuses
    evaluation on it before launch."""
    rows = split_rows(len(table), valid_fraction, seed)
    cut = split_text_tail(table, valid_fraction) if valid_fraction > 0 and len(table) == 1 else None
    if cut is not None:
        return cut, {"train": np.array([0]), "valid": np.array([1])}
    return table, rows


def _check_plan(out: Path, plan: dict) -> None:
    path = out / PLAN
    if path.is_file():
        old = read_json(path)
        if old != plan:
            changed = sorted(k for k in plan.keys() | old.keys() if plan.get(k) != old.get(k))
            raise DataError(f"{out} already holds a dataset prepared with different {changed}: choose another "
                            f"output directory or delete {out}")
    else:
        write_json_atomic(path, plan)


def _iter_texts(table: DocTable, field: str) -> Iterator[str]:
    for start in range(0, len(table), _TRAIN_CHUNK):
        yield from read_docs(table.subset(np.arange(start, min(start + _TRAIN_CHUNK, len(table)))), field)


def _iter_chat_texts(table: DocTable, fmt: str) -> Iterator[str]:
    for start in range(0, len(table), _TRAIN_CHUNK):
        rows = table.subset(np.arange(start, min(start + _TRAIN_CHUNK, len(table))))
        for row in read_conversation_rows(rows, fmt):
            if fmt == PROMPTS_FORMAT:  # (turns, answer): the answer is text a completion may have to spell
                yield from [m.content for m in row[0]] + ([row[1]] if row[1] else [])
                continue
            # A preference row is a pair of conversations; their shared prompt is read twice, as it is trained on.
            for messages in (row if fmt == PREFERENCE_FORMAT else (row,)):
                yield from (m.content for m in messages)


def _ensure_tokenizer(out: Path, src_tok, train: Callable[[Path], None]):
    """The dataset's tokenizer directory, created once (`train(dir)` makes it when no tokenizer was given); racers
    adopt whichever copy was published first."""
    tok_dir = out / TOKENIZER_DIR
    if not tok_dir.is_dir():
        tmp = temp_dir_for(tok_dir)
        try:
            if src_tok is not None:
                src_tok.save_pretrained(str(tmp))
            else:
                train(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish_dir(tmp, tok_dir)
    return load_hf_tokenizer(tok_dir)


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """`workers` processes started now, so that their start-up (an interpreter, numpy, tokenizers: ~0.4 s each)
    overlaps the parent's serial part (loading or training the tokenizer, planning, checking finished shards)
    instead of following it; None for one worker, which tokenizes in this process."""
    if workers <= 1:
        yield None
        return
    # spawn, not fork: the parent may hold torch / tokenizers thread pools that a fork would corrupt.
    # An executor (unlike multiprocessing.Pool) raises BrokenProcessPool if a worker dies instead of hanging.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=init_worker) as pool:
        for _ in range(workers):  # a spawn-context executor starts a process per submit while none is idle
            pool.submit(init_worker)
        yield pool


def _run(tasks: list[ShardTask], pool: ProcessPoolExecutor | None, progress: bool) -> None:
    docs = {t.name: len(t.docs) for t in tasks}
    start, tokens = time.perf_counter(), 0
    with tqdm(total=sum(docs.values()), unit="doc", desc="tokenizing", disable=not progress) as bar:
        for record in _records(tasks, pool):
            tokens += record["num_tokens"]
            bar.update(docs[record["name"]])
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s")


def _records(tasks: list[ShardTask], pool: ProcessPoolExecutor | None) -> Iterator[dict]:
    if pool is None or len(tasks) <= 1:
        yield from map(write_shard, tasks)
        return
    futures = [pool.submit(write_shard, t) for t in tasks]
    try:
        for future in as_completed(futures):
            yield future.result()
    finally:
        for future in futures:  # on an error, do not wait for the remaining shards
            future.cancel()


def _plan_tasks(out: Path, table: DocTable, rows: dict[str, np.ndarray], field: str,
                shards: dict[str, list[tuple[int, int]]], tok, train_on: str | None,
                line_format: str = AUTO) -> list[ShardTask]:
    """shards: per split, its shards' [start, end) ranges of that split's rows (group_by_size)."""
    backend = backend_json(tok)
    tok_hash, dtype = tokenizer_hash(backend), token_dtype(vocab_size_of(tok))
    # Chat shards also depend on how conversations render: the template and the special ids it inserts.
    chat = None if train_on is None else [train_on, getattr(tok, "chat_template", None) or "", tok.bos_token_id,
                                          tok.convert_tokens_to_ids([USER_MARKER, ASSISTANT_MARKER])]
    tasks = []
    for split in SPLITS:
        docs = table.subset(rows[split])
        for k, (a, b) in enumerate(shards[split]):
            part = docs.subset(np.arange(a, b))
            tasks.append(ShardTask(f"{split}-{k:05d}", str(out), part, field, backend, tok.eos_token_id, dtype,
                                   shard_key(part, field, tok_hash, tok.eos_token_id, dtype, chat), train_on,
                                   line_format))
    return tasks


def _meta(out: Path, tasks: list[ShardTask], plan_hash: str, tok) -> dict:
    splits = {split: {"num_docs": 0, "num_tokens": 0, "shards": []} for split in SPLITS}
    for task in tasks:
        record = read_json(shard_files(out, task.name)[2])
        split = splits[task.name.split("-")[0]]
        keys = ("name", "num_docs", "num_tokens", "bin_sha256", "idx_sha256", "mask_sha256", "prompts_sha256")
        # mask_sha256: chat shards only; prompts_sha256: prompts shards only (their texts and answers)
        split["shards"].append({k: record[k] for k in keys if k in record})
        split["num_docs"] += record["num_docs"]
        split["num_tokens"] += record["num_tokens"]
    vocab = vocab_size_of(tok)
    return {"format_version": FORMAT_VERSION, "plan_sha256": plan_hash,
            "tokenizer_hash": tokenizer_hash(backend_json(tok)), "vocab_size": vocab, "eos_id": tok.eos_token_id,
            "dtype": token_dtype(vocab), "num_docs": sum(s["num_docs"] for s in splits.values()),
            "num_tokens": sum(s["num_tokens"] for s in splits.values()), "splits": splits}


@dataclass(frozen=True)
class Planned:
    """What a prepare knows before it tokenizes: every shard's task, and what meta.json needs besides the shards."""
    out: Path
    tasks: list[ShardTask]
    plan_hash: str
    tok: Any
    extra: dict  # meta.json's keys beyond the shards' (skipped inputs, chat options, bad lines, ...)
    inputs: list[str]
    workers: int
    started: float = dataclasses.field(default_factory=time.time)  # when the plan was made


@contextlib.contextmanager
def planned(inputs: list[str], out_dir: str, tokenizer_dir: str | None = None, vocab_size: int = 2048,
            workers: int = 1, jsonl_field: str = "text", valid_fraction: float = 0.01, seed: int = 0,
            *, shard_mb: float = 16.0, progress: bool = True,
            extensions: tuple[str, ...] | None = DEFAULT_EXTENSIONS, data_format: str = TEXT_FORMAT,
            train_on: str = "all", skip_bad: bool = False, split: str | None = None,
            ) -> Iterator[tuple[Planned, ProcessPoolExecutor | None]]:
    """The serial part of a prepare (scan, split, plan, the tokenizer trained or imported once), with `workers`
    tokenizer processes started alongside it; yields the plan and that pool. prepare_dataset's arguments."""
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    if data_format not in INPUT_FORMATS:
        raise DataError(f"format {data_format!r}: use one of {', '.join(INPUT_FORMATS)}")
    if train_on not in TRAIN_ON:
        raise DataError(f"train_on {train_on!r}: use one of {', '.join(TRAIN_ON)}")
    chat = data_format != TEXT_FORMAT
    line_format = data_format if data_format in (ALPACA, SHAREGPT, PREFERENCE_FORMAT, PROMPTS_FORMAT) else AUTO
    stored_format = data_format if data_format in (PREFERENCE_FORMAT, PROMPTS_FORMAT) else CHAT_FORMAT
    if data_format == PREFERENCE_FORMAT:
        train_on = "last"  # each conversation of a pair is trained on its response (and EOS) only
    # Resolved before any input is scanned or worker started: a wrong --tokenizer is refused at once.
    tok_src = None if tokenizer_dir is None else str(resolve_tokenizer_dir(tokenizer_dir))
    out = Path(out_dir)
    bad: list[str] = []
    if chat:
        table, bad = scan_chat(inputs, skip_bad, line_format, split)
        rows = split_rows(len(table), valid_fraction, seed)
    else:
        table, rows = _split(scan_inputs(inputs, jsonl_field, extensions, split), valid_fraction, seed)
    shards = {split: group_by_size(table.size[rows[split]], int(shard_mb * 2**20)) for split in SPLITS}
    # Workers start before the tokenizer loads, at most one per shard; the pool closes (joining them) before meta.
    with worker_pool(min(workers, sum(map(len, shards.values())))) as pool:
        src_tok = None if tok_src is None else import_tokenizer(tok_src)
        plan = {"format_version": FORMAT_VERSION, "inputs": [str(Path(p).resolve()) for p in inputs],
                "docs_sha256": hashlib.sha256(json.dumps(table.refs()).encode()).hexdigest(), "num_docs": len(table),
                "jsonl_field": jsonl_field, "valid_fraction": valid_fraction, "seed": seed, "shard_mb": shard_mb,
                "tokenizer": ({"bpe_vocab_size": vocab_size} if src_tok is None
                              else {"imported_hash": tokenizer_hash(backend_json(src_tok))})}
        if chat:  # text plans keep their old keys, so datasets prepared before chat data existed still re-run
            plan.update(format=stored_format, train_on=train_on)
        plan_hash = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
        out.mkdir(parents=True, exist_ok=True)
        _check_plan(out, plan)
        train_docs = table.subset(rows["train"])
        if chat:
            # Without --tokenizer: a BPE with BOS and DeepSeek's chat markers, so DeepSeek-V3's chat format renders.
            tok = _ensure_tokenizer(out, src_tok, lambda d: train_bpe(_iter_chat_texts(train_docs, line_format),
                                                                      vocab_size, d, progress, chat=True))
            # Rendered here once, so a tokenizer that cannot render conversations fails before any shard is tokenized.
            first = read_conversation_rows(table.subset(np.arange(1)), line_format)[0]
            if line_format == PROMPTS_FORMAT:
                encode_prompt(tok, first[0])
            else:
                encode(tok, first[0] if line_format == PREFERENCE_FORMAT else first, train_on)
        else:
            tok = _ensure_tokenizer(out, src_tok, lambda d: train_bpe(_iter_texts(train_docs, jsonl_field), vocab_size,
                                                                      d, progress))
        tasks = _plan_tasks(out, table, rows, jsonl_field, shards, tok, train_on if chat else None, line_format)
        extra: dict = {"skipped_inputs": list(table.skipped)}
        if table.read_splits:
            extra["read_splits"] = list(table.read_splits)
        if chat:
            # The first few errors are kept for the summary; the count is of all lines skipped.
            extra.update(format=stored_format, train_on=train_on, bad_lines=len(bad), bad_line_errors=bad[:5])
        if src_tok is None:
            extra["requested_vocab_size"] = vocab_size
        yield Planned(out, tasks, plan_hash, tok, extra, list(inputs), workers), pool


def finish(prep: Planned) -> str:
    """meta.json from the finished shards' records (written last: its presence says the dataset is complete)."""
    meta = _meta(prep.out, prep.tasks, prep.plan_hash, prep.tok)
    meta.update(prep.extra)
    if meta.get("format") == PREFERENCE_FORMAT:
        meta["identical_pairs"] = sum(read_json(shard_files(prep.out, t.name)[2]).get("identical_pairs", 0)
                                      for t in prep.tasks)
    if meta.get("format") == PROMPTS_FORMAT:  # reward functions that compare with an answer need one per prompt
        meta["unanswered"] = {split: sum(a is None for t in prep.tasks if t.name.startswith(f"{split}-")
                                         for a in read_json(shard_files(prep.out, t.name)[2])["answers"])
                              for split in SPLITS}
    if meta["splits"]["train"]["num_tokens"] == 0:
        raise DataError(f"inputs {prep.inputs} produced no training tokens (only empty or whitespace documents): "
                        f"pass inputs with text")
    remove_dead_temporaries(prep.tasks, prep.started)
    write_json_atomic(prep.out / META, meta)
    return str(prep.out)


def run_tasks(tasks: list[ShardTask], pool: ProcessPoolExecutor | None, progress: bool) -> int:
    """Tokenize the tasks not already done on disk (with the pool's workers); returns how many were."""
    todo = [t for t in tasks if not is_done(t)]
    _run(todo, pool, progress)
    return len(todo)


def prepare_dataset(inputs: list[str], out_dir: str, tokenizer_dir: str | None = None, vocab_size: int = 2048,
                    workers: int = 1, jsonl_field: str = "text", valid_fraction: float = 0.01, seed: int = 0,
                    *, shard_mb: float = 16.0, progress: bool = True,
                    extensions: tuple[str, ...] | None = DEFAULT_EXTENSIONS, data_format: str = TEXT_FORMAT,
                    train_on: str = "all", skip_bad: bool = False, split: str | None = None) -> str:
    """Tokenize `inputs` into a packed, checksummed dataset at `out_dir` and return `out_dir`.

    With `tokenizer_dir` the dataset uses that HF tokenizer; otherwise a byte-level BPE of `vocab_size`
    is trained on the training documents. Shards hold about `shard_mb` of text each; the output does not
    depend on `workers`. Re-running continues an interrupted run and verifies a finished one. Directory inputs
    contribute files with one of `extensions` (None: all); meta.json lists the files skipped.

    `data_format` "chat": the inputs are .jsonl conversations (data/chat.py), each stored as one sample with a
    trained mask (assistant turns: all, or the last with `train_on` "last"); a bad line is an error naming its
    file:line, or skipped and counted in meta.json with `skip_bad`. Whole conversations are held out for validation.
    Each record's format (messages, prompt/response, Alpaca, ShareGPT: formats.py) is told from its keys;
    `data_format` "alpaca" or "sharegpt" makes a chat dataset of records that must all be in that format;
    "preference" a preference dataset of {"prompt", "chosen", "rejected"} records (data/pairs.py), two samples a
    pair (layout.py), with a count of the pairs whose chosen and rejected are the same; "prompts" a prompts dataset
    of {"prompt"} or {"messages"} records with an optional "answer" (data/prompts.py), each rendered up to the
    assistant's turn.
    A saved DatasetDict input contributes its split `split` ("train" when None); meta.json says which.
    """
    with planned(inputs, out_dir, tokenizer_dir, vocab_size, workers, jsonl_field, valid_fraction, seed,
                 shard_mb=shard_mb, progress=progress, extensions=extensions, data_format=data_format,
                 train_on=train_on, skip_bad=skip_bad, split=split) as (prep, pool):
        run_tasks(prep.tasks, pool, progress)
    return finish(prep)
