"""`deepseek-ds bench data`: end-to-end prepare throughput with N workers next to raw `tokenizers`
batch encoding of the same text on one thread (what each prepare worker runs on), as a printed table with the
ratios: prepare against N x the raw per-worker rate, and N workers against one."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from ..data import dataset_info, ensure_builtin_dataset, prepare_dataset
from ..data.builtin import stdlib_files
from ..data.layout import TOKENIZER_DIR
from ..data.tokenizer import backend_json, load_hf_tokenizer
from ..utils.cli_args import spellings
from ..utils.fmt import text_table
from ..utils.system import usable_cpus

# Several shards per worker so extra workers have something to do.
_SHARD_MB = 0.5


@contextlib.contextmanager
def _one_thread_per_worker():
    """tokenizers' rayon pool off, as in every prepare worker (shards.init_worker), also for the raw baseline and
    the in-process single worker: a worker is then one core, so the ratios compare like with like."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _raw_encode(texts: list[str], backend: str) -> tuple[float, int]:
    tok = Tokenizer.from_str(backend)
    start = time.perf_counter()
    tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return time.perf_counter() - start, tokens


def run_data_bench(workers: list[int], mb: float, vocab_size: int, work_dir: str) -> list[dict]:
    """Rows of (method, workers, seconds, tokens, tokens/s, MB/s) on the built-in corpus of `mb` MB; the first is
    the raw one-thread baseline, and each prepare row has `vs_raw` (its tokens/s over workers x the raw rate) and
    `vs_one` (over the first prepare row's tokens/s, per worker)."""
    files = stdlib_files(mb)
    texts = [Path(f).read_text() for f in files]
    text_mb = sum(len(t.encode()) for t in texts) / 2**20
    tok_dir = Path(ensure_builtin_dataset(work_dir, vocab_size, mb, progress=False)) / TOKENIZER_DIR
    with _one_thread_per_worker():
        seconds, tokens = _raw_encode(texts, backend_json(load_hf_tokenizer(tok_dir)))
        rows = [{"method": "tokenizers encode_batch, 1 thread (raw)", "workers": 1, "seconds": seconds,
                 "tokens": tokens}]
        for n in workers:
            start = time.perf_counter()
            out = prepare_dataset(files, f"{work_dir}/w{n}", tokenizer_dir=str(tok_dir), workers=n,
                                  valid_fraction=0.0, shard_mb=_SHARD_MB, progress=False)
            rows.append({"method": f"prepare, {n} worker{'s' if n > 1 else ''}", "workers": n,
                         "seconds": time.perf_counter() - start, "tokens": dataset_info(out)["num_tokens"]})
    for row in rows:
        row["tokens/s"] = row["tokens"] / row["seconds"]
        row["MB/s"] = text_mb / row["seconds"]
    raw, first = rows[0], rows[1]
    for row in rows[1:]:
        row["vs_raw"] = row["tokens/s"] / (row["workers"] * raw["tokens/s"])
        row["vs_one"] = row["tokens/s"] * first["workers"] / (row["workers"] * first["tokens/s"])
    return rows


def format_table(rows: list[dict]) -> str:
    """`vs raw/worker`: tokens/s over workers x the raw one-thread rate; `scaling/worker`: tokens/s per worker over
    the first prepare row's (1.00 = linear)."""
    cells = [[r["method"], f"{r['seconds']:.2f}", f"{r['tokens']:,}", f"{r['tokens/s']:,.0f}", f"{r['MB/s']:.2f}",
              f"{r['vs_raw']:.2f}" if "vs_raw" in r else "-", f"{r['vs_one']:.2f}" if "vs_one" in r else "-"]
             for r in rows]
    return text_table(cells, ["method", "seconds", "tokens", "tokens/s", "MB/s", "vs raw/worker", "scaling/worker"])


def _bench(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        print(format_table(run_data_bench(args.workers, args.mb, args.vocab_size, args.work_dir or tmp)))
    print(f"{usable_cpus()} usable cores; workers beyond that share them")
    return 0


def register(subparsers) -> None:
    """Add `data` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("data", help="data preparation throughput vs raw tokenizers")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare (default 1 2)")
    p.add_argument("--mb", type=float, default=8.0, help="MB of built-in corpus text (default 8)")
    p.add_argument(*spellings("--vocab-size"), type=int, default=2048, help="BPE vocabulary size (default 2048)")
    p.add_argument(*spellings("--work-dir"), help="keep outputs here (default: a temporary directory)")
    p.set_defaults(func=_bench)
