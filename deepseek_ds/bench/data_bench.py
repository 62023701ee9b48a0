"""`deepseek-ds bench data`: end-to-end prepare throughput with N workers next to raw `tokenizers`
batch encoding of the same text on one thread (what each prepare worker runs on), as a printed table with the
ratios: prepare against N x the raw per-worker rate, and N workers against one.

Wall-clock rates on a shared machine say as much about the other jobs as about ours, so each row also shows the
CPU time it got: `cores` (CPU seconds over wall seconds: N workers scale linearly only when they get N cores) and
`CPU vs raw` (tokens per CPU second over the raw encoder's: the per-worker efficiency, start-up and hand-over of
the workers included, whatever the load)."""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
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


def _cpu_seconds() -> float:
    """This process's CPU time and its finished children's (prepare's worker processes, joined when it returns)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _timed(row: dict):
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    row["seconds"], row["cpu_s"] = time.perf_counter() - wall, _cpu_seconds() - cpu


def _raw_encode(texts: list[str], backend: str) -> dict:
    tok = Tokenizer.from_str(backend)
    row = {"method": "tokenizers encode_batch, 1 thread (raw)", "workers": 1}
    with _timed(row):
        row["tokens"] = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return row


def run_data_bench(workers: list[int], mb: float, vocab_size: int, work_dir: str) -> list[dict]:
    """Rows of (method, workers, seconds, cpu_s, tokens, tokens/s, per_worker, MB/s, cores) on the built-in corpus
    of `mb` MB; the first is the raw one-thread baseline, and each prepare row has `vs_raw` (its tokens/s per worker
    over the raw rate), `vs_one` (its tokens/s per worker over the first prepare row's) and `cpu_vs_raw` (its tokens
    per CPU second over the raw baseline's)."""
    files = stdlib_files(mb)
    texts = [Path(f).read_text() for f in files]
    text_mb = sum(len(t.encode()) for t in texts) / 2**20
    tok_dir = Path(ensure_builtin_dataset(work_dir, vocab_size, mb, progress=False)) / TOKENIZER_DIR
    with _one_thread_per_worker():
        rows = [_raw_encode(texts, backend_json(load_hf_tokenizer(tok_dir)))]
        for n in workers:
            row = {"method": f"prepare, {n} worker{'s' if n > 1 else ''}", "workers": n}
            with _timed(row):
                out = prepare_dataset(files, f"{work_dir}/w{n}", tokenizer_dir=str(tok_dir), workers=n,
                                      valid_fraction=0.0, shard_mb=_SHARD_MB, progress=False)
            row["tokens"] = dataset_info(out)["num_tokens"]
            rows.append(row)
    for row in rows:
        row["tokens/s"] = row["tokens"] / row["seconds"]
        row["per_worker"] = row["tokens/s"] / row["workers"]
        row["MB/s"] = text_mb / row["seconds"]
        row["cores"] = row["cpu_s"] / row["seconds"]
    raw, first = rows[0], rows[1]
    for row in rows[1:]:
        row["vs_raw"] = row["per_worker"] / raw["tokens/s"]
        row["vs_one"] = row["per_worker"] / first["per_worker"]
        row["cpu_vs_raw"] = (row["tokens"] / row["cpu_s"]) / (raw["tokens"] / raw["cpu_s"])
    return rows


HEADERS = ["method", "seconds", "tokens", "tokens/s", "tokens/s/worker", "MB/s", "cores", "vs raw/worker",
           "scaling/worker", "CPU vs raw"]


def format_table(rows: list[dict]) -> str:
    """`vs raw/worker`: tokens/s per worker over the raw one-thread rate; `scaling/worker`: tokens/s per worker over
    the first prepare row's (1.00 = linear); `cores`: CPU seconds over wall seconds; `CPU vs raw`: tokens per CPU
    second over the raw encoder's."""
    def ratio(r, key):
        return f"{r[key]:.2f}" if key in r else "-"

    cells = [[r["method"], f"{r['seconds']:.2f}", f"{r['tokens']:,}", f"{r['tokens/s']:,.0f}",
              f"{r['per_worker']:,.0f}", f"{r['MB/s']:.2f}", f"{r['cores']:.2f}", ratio(r, "vs_raw"),
              ratio(r, "vs_one"), ratio(r, "cpu_vs_raw")] for r in rows]
    return text_table(cells, HEADERS)


def _bench(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        print(format_table(run_data_bench(args.workers, args.mb, args.vocab_size, args.work_dir or tmp)))
    print(f"{usable_cpus()} usable cores, load average {os.getloadavg()[0]:.1f}: N workers scale linearly only "
          "with N cores free (the `cores` column)")
    return 0


def register(subparsers) -> None:
    """Add `data` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("data", help="data preparation throughput vs raw tokenizers")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare (default 1 2)")
    p.add_argument("--mb", type=float, default=8.0, help="MB of built-in corpus text (default 8)")
    p.add_argument(*spellings("--vocab-size"), type=int, default=2048, help="BPE vocabulary size (default 2048)")
    p.add_argument(*spellings("--work-dir"), help="keep outputs here (default: a temporary directory)")
    p.set_defaults(func=_bench)
