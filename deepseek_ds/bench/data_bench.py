"""`deepseek-ds bench data`: end-to-end prepare throughput with N workers next to raw `tokenizers` batch
encoding of the same text on one thread (what each prepare worker runs on), as a printed table with the ratios:
prepare against N x the raw per-worker rate, and N workers against one.

Two raw rows: `encode_batch`, what a hand-written tokenizing loop calls (the baseline a user compares with), and
`encode_batch_fast`, the same ids without character offsets, which is the call prepare makes: prepare over the
first is what a user gains or loses, over the second what prepare's own work (reading, EOS, numpy, hashing,
writing, start-up) costs on top of the same tokenizer call.

Wall-clock rates on a shared machine say as much about the other jobs as about ours, so each row also shows the
CPU time it got: `cores` (CPU seconds over wall seconds: N workers scale linearly only when they get N cores) and
`CPU vs fast` (tokens per CPU second over the raw `encode_batch_fast`'s: the per-worker efficiency, start-up and
hand-over of the workers included, whatever the load).

Each row is the round of median wall time out of `--repeats` rounds, and every round runs all the rows back to
back (raw, raw fast, 1 worker, 2 workers, raw, ...): a load that comes and goes on a shared host then hits every
row alike instead of whichever ran while it lasted. Each row runs in a new interpreter, as a user's run does (one
process carries the heap of what ran before it into the next row), with its imports done before its clock starts.
Each prepare round builds a fresh dataset; its workers' start-up is in its row (prepare starts them while it loads
the tokenizer), as it is in every `data prepare` run."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from ..data import dataset_info, ensure_builtin_dataset, prepare_dataset
from ..data.builtin import stdlib_files
from ..data.layout import TOKENIZER_DIR
from ..data.shards import init_worker
from ..data.tokenizer import backend_json, load_hf_tokenizer
from ..launcher.hostfile import read_hostfile, select_slots
from ..utils.cli_args import add_hostfile, add_master_port, positive_int, spellings
from ..utils.fmt import text_table
from ..utils.system import usable_cpus
from .data_hosts_bench import bench_hosts
from .load import HostLoad, add_allow_busy, check_quiet_host

# Several shards per worker so extra workers have something to do.
_SHARD_MB = 0.5


def _cpu_seconds() -> float:
    """This process's CPU time and its finished children's (prepare's worker processes, joined when it returns)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _timed(row: dict):
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    row["seconds"], row["cpu_s"] = time.perf_counter() - wall, _cpu_seconds() - cpu


RAW_METHODS = ("encode_batch", "encode_batch_fast")


def _raw_encode(files: list[str], backend: str, method: str) -> dict:
    texts = [Path(f).read_text() for f in files]
    encode = getattr(Tokenizer.from_str(backend), method)
    row = {"method": f"tokenizers {method}, 1 thread (raw)", "workers": 1}
    with _timed(row):
        row["tokens"] = sum(len(e.ids) for e in encode(texts, add_special_tokens=False))
    return row


def _prepare(files: list[str], tok_dir: Path, n: int, out: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # a fresh build each round, not a re-run that verifies the last one
    load_hf_tokenizer(tok_dir)  # imports transformers before the clock starts, as the raw rows import tokenizers
    row = {"method": f"prepare, {n} worker{'s' if n > 1 else ''}", "workers": n}
    with _timed(row):
        prepare_dataset(files, out, tokenizer_dir=str(tok_dir), workers=n, valid_fraction=0.0, shard_mb=_SHARD_MB,
                        progress=False)
    row["tokens"] = dataset_info(out)["num_tokens"]
    return row


def _in_fresh_process(measure: Callable[..., dict], *args) -> dict:
    """One row measured in a new interpreter, as a user's run starts. Rows measured one after another in one process
    inherit the heap the previous ones left: encode_batch_fast over 8 MB took 4.5 CPU s first in a process and
    7.5 s right after an encode_batch of the same text. tokenizers' own thread pool is off there (init_worker), as
    in every prepare worker: a worker is one core, so the ratios compare like with like."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=init_worker) as pool:
        return pool.submit(measure, *args).result()


def _per_worker(row: dict) -> float:
    return row["tokens"] / row["seconds"] / row["workers"]


def _median_round(rounds: list[dict]) -> dict:
    """The round of median wall time (the lower middle one of an even count): a measured round, its CPU time with it."""
    return sorted(rounds, key=lambda r: r["seconds"])[(len(rounds) - 1) // 2]


def run_data_bench(workers: list[int], mb: float, vocab_size: int, work_dir: str, repeats: int = 1) -> list[dict]:
    """Rows of (method, workers, seconds, cpu_s, tokens, tokens/s, per_worker, MB/s, cores) on the built-in corpus
    of `mb` MB, each the median of `repeats` rounds of all rows; the first two are the raw one-thread baselines
    (RAW_METHODS), and each prepare row has `vs_raw` and `vs_fast` (its tokens/s per worker over the raw
    encode_batch and encode_batch_fast rates), `vs_one` (its tokens/s per worker over the first prepare row's) and
    `cpu_vs_fast` (its tokens per CPU second over the raw encode_batch_fast's)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}: pass --repeats 1 or more")
    files = stdlib_files(mb)
    text_mb = sum(len(Path(f).read_text().encode()) for f in files) / 2**20
    tok_dir = Path(ensure_builtin_dataset(work_dir, vocab_size, mb, progress=False)) / TOKENIZER_DIR
    backend = backend_json(load_hf_tokenizer(tok_dir))
    rounds = [[_in_fresh_process(_raw_encode, files, backend, m) for m in RAW_METHODS]
              + [_in_fresh_process(_prepare, files, tok_dir, n, f"{work_dir}/w{n}") for n in workers]
              for _ in range(repeats)]
    rows = [_median_round([r[k] for r in rounds]) for k in range(len(rounds[0]))]
    first_prep = len(RAW_METHODS)
    for k in range(first_prep + 1, len(rows)):  # each round's N workers against the 1 worker it ran right after
        rows[k]["round_scaling"] = [_per_worker(r[k]) / _per_worker(r[first_prep]) for r in rounds]
        rows[k]["round_cores"] = [r[k]["cpu_s"] / r[k]["seconds"] for r in rounds]
    for row in rows:
        row["tokens/s"] = row["tokens"] / row["seconds"]
        row["per_worker"] = row["tokens/s"] / row["workers"]
        row["MB/s"] = text_mb / row["seconds"]
        row["cores"] = row["cpu_s"] / row["seconds"]
    raw, fast, first = rows[0], rows[1], rows[first_prep]
    for row in rows[first_prep:]:
        row["vs_raw"] = row["per_worker"] / raw["tokens/s"]
        row["vs_fast"] = row["per_worker"] / fast["tokens/s"]
        row["vs_one"] = row["per_worker"] / first["per_worker"]
        row["cpu_vs_fast"] = (row["tokens"] / row["cpu_s"]) / (fast["tokens"] / fast["cpu_s"])
    return rows


HEADERS = ["method", "seconds", "tokens", "tokens/s", "tokens/s/worker", "MB/s", "cores", "vs raw/worker",
           "vs fast/worker", "scaling/worker", "CPU vs fast"]


def format_table(rows: list[dict]) -> str:
    """`vs raw/worker`: tokens/s per worker over the raw encode_batch rate on one thread; `vs fast/worker`: the same
    over the raw encode_batch_fast rate (prepare's own call); `scaling/worker`: tokens/s per worker over the first
    prepare row's (1.00 = linear); `cores`: CPU seconds over wall seconds; `CPU vs fast`: tokens per CPU second over
    the raw encode_batch_fast's."""
    def ratio(r, key):
        return f"{r[key]:.2f}" if key in r else "-"

    cells = [[r["method"], f"{r['seconds']:.2f}", f"{r['tokens']:,}", f"{r['tokens/s']:,.0f}",
              f"{r['per_worker']:,.0f}", f"{r['MB/s']:.2f}", f"{r['cores']:.2f}", ratio(r, "vs_raw"),
              ratio(r, "vs_fast"), ratio(r, "vs_one"), ratio(r, "cpu_vs_fast")] for r in rows]
    return text_table(cells, HEADERS)


def format_rounds(rows: list[dict]) -> str:
    """Per round, each multi-worker row's `scaling/worker` against the one worker of the same round, with its median:
    side by side in time, so less at the mercy of a load that changed between rounds than the medians' ratio."""
    def values(xs):
        return " ".join(f"{x:.2f}" for x in xs)

    return "\n".join(f"{r['method']}, round by round: scaling/worker {values(r['round_scaling'])} (median "
                     f"{statistics.median(r['round_scaling']):.2f}), cores {values(r['round_cores'])}"
                     for r in rows if "round_scaling" in r)


def _bench(args: argparse.Namespace) -> int:
    if args.out:
        check_quiet_host(args.allow_busy)
    if args.hostfile:
        return bench_hosts(args, list(select_slots(read_hostfile(args.hostfile))))
    with tempfile.TemporaryDirectory() as tmp, HostLoad() as load:
        rows = run_data_bench(args.workers, args.mb, args.vocab_size, args.work_dir or tmp, args.repeats)
    text = "\n".join([format_table(rows), f"{usable_cpus()} usable cores, load average {os.getloadavg()[0]:.1f}: N "
                      "workers scale linearly only with N cores free (the `cores` column)", format_rounds(rows)])
    print(text)
    if args.out:
        from .report import write_process_report  # torch and DeepSpeed, imported only after the measurement

        path = os.path.join(args.out, "data.md")
        write_process_report(path, "Data preparation vs the raw tokenizer", (
            f"`data prepare` of {args.mb:g} MB of the built-in corpus with each worker count, next to two raw "
            "`tokenizers` calls on one thread: `encode_batch` (what a hand-written loop calls) and "
            "`encode_batch_fast` (the same ids without offsets, prepare's own call). Each row runs in a new "
            f"interpreter, its imports done before its clock starts; each is the median of {args.repeats} rounds "
            "that run every row back to back."), ["```\n" + text + "\n```"], load=load)
        print(f"wrote {path}")
    return 0


def register(subparsers) -> None:
    """Add `data` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("data", help="data preparation throughput vs raw tokenizers")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare (default 1 2)")
    p.add_argument("--mb", type=float, default=8.0, help="MB of built-in corpus text (default 8)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="rounds of all rows, each row showing its median round (default 3)")
    p.add_argument(*spellings("--vocab-size"), type=int, default=2048, help="BPE vocabulary size (default 2048)")
    p.add_argument(*spellings("--work-dir"), help="keep outputs here (default: a temporary directory)")
    p.add_argument("--out", default=None, help="write the report OUT/data.md (OUT/data-hosts.md with --hostfile; "
                   "default: print only)")
    add_allow_busy(p)
    add_hostfile(p, help="instead: `data prepare --hostfile` on the first N hosts of this hostfile for each --hosts N, "
                 "with the first --workers count a host, next to the same prepare on this host without a hostfile")
    p.add_argument("--hosts", type=positive_int, nargs="+", default=[1, 2, 4],
                   help="with --hostfile: host counts to compare (default 1 2 4)")
    add_master_port(p, default=29500, help="with --hostfile: the launcher's --master_port (default 29500)")
    p.set_defaults(func=_bench)
