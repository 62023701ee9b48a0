"""`deepseek-ds bench data --hostfile H`: `data prepare` across 1, 2, 4 ... hosts of a hostfile, end to end as a user
runs it (preflight, plan, the launcher starting each host's share, meta.json), next to the same prepare on this host
without a hostfile, the alternative a user would pick. Every run imports one tokenizer (trained once, untimed), so
the rows time tokenization and its orchestration only. Each row is the round of median wall time of `--repeats`,
every round running all rows back to back."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..data import dataset_info, ensure_builtin_dataset
from ..data.builtin import stdlib_files
from ..data.layout import TOKENIZER_DIR
from ..utils.fmt import text_table
from ..utils.system import usable_cpus
from .load import HostLoad


def _prepare(files: list[str], tok_dir: Path, out: Path, workers: int, hosts_args: list[str]) -> dict:
    command = [sys.executable, "-m", "deepseek_ds", "data", "prepare", "--input", *files, "--out", str(out),
               "--tokenizer", str(tok_dir), "--workers", str(workers), "--valid-fraction", "0", "--shard-mb", "0.5",
               "--no-progress", *hosts_args]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    tokens = dataset_info(str(out))["num_tokens"]
    # Each host's own line: "host K of N: S shards, T tokens in X s (...)"; the slowest one bounds the tokenizing.
    shares = [float(m) for m in re.findall(r"host \d+ of \d+: .* tokens in ([\d.]+) s", done.stdout)]
    return {"seconds": seconds, "tokens": tokens, "tokenizing_s": max(shares) if shares else None}


def corpus_files(mb: float, work_dir: str) -> list[str]:
    """`mb` MB of the built-in corpus; past its size (about 12 MB) its files again, copied under work_dir."""
    files = stdlib_files(mb)
    total, copy = sum(os.path.getsize(f) for f in files), 0
    base = list(files)
    while total < mb * 2**20:
        copy += 1
        for f in base:
            if total >= mb * 2**20:
                break
            target = Path(work_dir) / "corpus" / f"copy{copy}" / Path(f).name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
            files.append(str(target))
            total += os.path.getsize(f)
    return files


def run_hosts_bench(hostfile: str, hosts: list[str], counts: list[int], workers: int, mb: float, vocab_size: int,
                    work_dir: str, repeats: int, master_port: int) -> list[dict]:
    """Rows of (method, hosts, seconds, tokens, tokens/s, vs_local, vs_one_host): this host without a hostfile first,
    then the first N hosts of the hostfile for each N in `counts`."""
    files = corpus_files(mb, work_dir)
    tok_dir = Path(ensure_builtin_dataset(work_dir, vocab_size, 2.0, progress=False)) / TOKENIZER_DIR
    methods = [("prepare on this host, no hostfile", 0, [])] + [
        (f"prepare --hostfile, {n} host{'s' * (n != 1)}", n,
         ["--hostfile", hostfile, "--include", "@".join(hosts[:n]), "--master_port", str(master_port)])
        for n in counts]
    rounds = []
    for k in range(repeats):
        rounds.append([_prepare(files, tok_dir, Path(work_dir) / f"r{k}-{n}", workers, args)
                       for _, n, args in methods])
    rows = []
    for j, (method, n, _) in enumerate(methods):
        measured = sorted((r[j] for r in rounds), key=lambda m: m["seconds"])[(repeats - 1) // 2]
        rows.append({"method": method, "hosts": n or 1, **measured,
                     "tokens/s": measured["tokens"] / measured["seconds"],
                     "all_seconds": [r[j]["seconds"] for r in rounds]})
    local = rows[0]["tokens/s"]
    one_host = next((r["tokens/s"] for r in rows[1:] if r["hosts"] == 1), None)
    for row in rows:
        row["vs_local"] = row["tokens/s"] / local
        if one_host and row is not rows[0]:
            row["vs_one_host"] = row["tokens/s"] / one_host
    return rows


HEADERS = ["method", "seconds", "tokens", "tokens/s", "vs this host", "vs 1 host", "slowest host's share (s)",
           "tokens/s of the shares", "rounds (s)"]


def format_table(rows: list[dict]) -> str:
    """`slowest host's share`: the longest time a host spent tokenizing its share (its own line); `tokens/s of the
    shares`: the tokens over it, the rate without the fixed cost of preflight, plan and launch."""
    def ratio(r, key):
        return f"{r[key]:.2f}" if key in r else "-"

    def share(r):
        return ("-", "-") if not r.get("tokenizing_s") else (f"{r['tokenizing_s']:.1f}",
                                                              f"{r['tokens'] / r['tokenizing_s']:,.0f}")

    cells = [[r["method"], f"{r['seconds']:.2f}", f"{r['tokens']:,}", f"{r['tokens/s']:,.0f}", ratio(r, "vs_local"),
              ratio(r, "vs_one_host"), *share(r), " ".join(f"{s:.1f}" for s in r["all_seconds"])] for r in rows]
    return text_table(cells, HEADERS)


def bench_hosts(args, hosts: list[str]) -> int:
    """`bench data --hostfile`: the table, and with --out the report OUT/data-hosts.md."""
    counts = [n for n in args.hosts if n <= len(hosts)]
    with tempfile.TemporaryDirectory() as tmp, HostLoad() as load:
        rows = run_hosts_bench(args.hostfile, hosts, counts, args.workers[0], args.mb, args.vocab_size,
                               args.work_dir or tmp, args.repeats, args.master_port)
    cores = usable_cpus()
    text = "\n".join([format_table(rows), f"{cores} usable cores on this machine, load average "
                      f"{os.getloadavg()[0]:.1f}; median of {args.repeats} rounds "
                      f"(spread of the last row: {statistics.pstdev(rows[-1]['all_seconds']):.2f} s)"])
    print(text)
    if args.out:
        from .report import write_process_report  # torch and DeepSpeed, imported only after the measurement

        path = os.path.join(args.out, "data-hosts.md")
        write_process_report(path, "Data preparation across hosts", (
            f"`data prepare --hostfile` of {args.mb:g} MB of the built-in corpus (its files repeated past its 12 MB) on the first 1, 2, 4 ... hosts of "
            f"{args.hostfile} with {args.workers[0]} worker(s) a host, end to end (preflight, plan, the DeepSpeed "
            "launcher starting every host's share over pdsh and ssh, meta.json), next to the same prepare on this "
            "host without a hostfile. One imported tokenizer (trained once, untimed). Where the hosts are the "
            "namespace test cluster (launch/testcluster.sh) they share this machine's cores, so tokens/s can grow "
            f"only up to {cores} / {args.workers[0]} = {cores / args.workers[0]:g}x over one host; on a real "
            "cluster each host brings its own cores and the fixed cost (preflight, plan and the launcher: the 1-host "
            "row's excess over the local row) is what does not shrink; the share columns leave it out."), ["```\n" + text + "\n```"],
            load=load)
        print(f"wrote {path}")
    return 0
