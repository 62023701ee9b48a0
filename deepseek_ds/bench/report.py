"""Benchmark reports: rows as a markdown table and a CSV, PNG charts, and the environment the numbers were
measured on (hardware, library versions, git commit), shared by `bench zero` and `bench pipeline`."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import psutil
import torch
import transformers

from ..utils.fmt import human_bytes
from ..utils.fmt import markdown_table as _markdown_table
from ..utils.fs import write_bytes_atomic
from ..utils.system import cpu_model, cpu_threads_per_rank, usable_cpus
from .load import HostLoad


@dataclass(frozen=True)
class Column:
    key: str          # the row's field; also the CSV header
    header: str       # the markdown header
    fmt: str = "{}"   # str.format pattern for the markdown cell ("-" where the value is None)


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "bytes":
        return human_bytes(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return fmt.format(value)


def markdown_table(rows: list[dict], columns: list[Column]) -> str:
    return _markdown_table([[cell(r.get(c.key), c.fmt) for c in columns] for r in rows], [c.header for c in columns])


def write_csv(path: str, rows: list[dict], columns: list[Column]) -> None:
    """Raw values (bytes as integers, seconds as floats) so the CSV can be re-analysed."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([c.key for c in columns])
        for r in rows:
            w.writerow(["" if r.get(c.key) is None else r.get(c.key) for c in columns])


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on cluster nodes). Imported here: the backend
    must be chosen before pyplot is first imported, and only the report writers need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------------------------- environment
def _git_commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def command_line() -> str:
    """This process's command as it would be typed again: `python -m MODULE ...` for a module run (its argv[0] is
    only the module's file), `python PATH ...` for a script (PATH from the repository root where it is inside), the
    name of an installed command (`deepseek-ds ...`) otherwise."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        prog = f"python -m {spec.name.removesuffix('.__main__')}"
    elif sys.argv[0].endswith(".py"):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.path.abspath(sys.argv[0])
        prog = f"python {os.path.relpath(path, root) if path.startswith(root + os.sep) else path}"
    else:
        prog = os.path.basename(sys.argv[0])
    return " ".join([prog] + sys.argv[1:])


def environment(ranks: list[dict], load: HostLoad | None = None) -> dict[str, str]:
    """Where the numbers come from. `ranks` are the worker's per-rank reports (of every launch: the threads are
    what the ranks measured, each row's): their devices (the GPUs may be on other hosts than the one writing the
    report) and torch threads. `load`: the host's load while the benchmark ran."""
    devices: dict[str, int] = {}
    for r in ranks:
        devices[r["device"]] = devices.get(r["device"], 0) + 1
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "ranks' devices": ", ".join(f"{n} x {d}" for d, n in devices.items()) or "-",
        "torch threads per rank (as the ranks measured them)": ", ".join(
            sorted({str(r["threads"]) for r in ranks})) or "-",
        "OpenMP environment": " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
                                       if k in os.environ) or "not set (the launch sets OMP_NUM_THREADS)",
        "host CPU": f"{cpu_model()}, {usable_cpus()} usable cores of {os.cpu_count()}",
        "host GPUs": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "none",
        "host memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        # A shared host's other work slows the numbers down: say how busy it was.
        **({"host load during the benchmark": load.describe()} if load is not None else {}),
        "host load average (1, 5, 15 min) when the report was written": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
        "OS": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__ + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""),
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "git commit": _git_commit(),
        "command": command_line(),
    }


def on_cpu(ranks: list[dict]) -> bool:
    return all(r["device"].startswith("CPU") for r in ranks)


def threads_header(threads: int, max_ranks: int) -> str:
    """The header's sentence on threads: what every row was launched with (threads_note says what they ran)."""
    how = (f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} was set for this run" if "OMP_NUM_THREADS" in os.environ
           else f"the {usable_cpus()} usable cores divided by the largest launch's {max_ranks} local ranks")
    return f"Every rank of every row is launched with {threads} torch thread(s) ({how})."


def threads_note(ranks: list[dict]) -> str:
    """What the rows ran with, as the ranks measured it (torch.get_num_threads() in the worker)."""
    measured = sorted({r["threads"] for r in ranks})
    if len(measured) > 1:
        return (f"\n\n**Threads: the rows do not compare.** Ranks ran {' or '.join(map(str, measured))} torch "
                "threads: a rank with more threads computes faster alone and stalls more on a shared host.")
    return (f"\n\n**Threads.** Every rank of every row ran {measured[0]} torch thread(s) (measured in the ranks). "
            "The same number for every row, chosen for the largest launch: with one thread per core in every rank, "
            "OpenMP's spin-waiting threads of co-located ranks starve each other (ZeRO-0 ran about 30x slower on a "
            "2-core host), and a rank alone on all the cores stalls whenever other work holds one of them.")


def environment_markdown(env: dict[str, str]) -> str:
    return "\n".join(f"- **{k}**: {v}" for k, v in env.items())


def write_markdown(path: str, blocks: list[str]) -> None:
    """Atomically: a kill mid-write (a GPU machine's time limit) leaves the previous complete report. Empty blocks
    (a quiet host's banner) are left out."""
    write_bytes_atomic(Path(path), ("\n\n".join(b.strip("\n") for b in blocks if b.strip()) + "\n").encode())


def write_process_report(path: str, title: str, what: str, blocks: list[str], ranks: int = 1,
                         command: str | None = None, load: HostLoad | None = None) -> None:
    """The report of a benchmark run by this process (and its workers) or of a demo script whose launches it sums up:
    its title, what it measured, where (environment(): `ranks` ranks on this host's device, `command` the one that
    ran, default this process's; `load`: the host's load while it ran, a busy host's banner on top) and its
    tables."""
    device = f"CUDA {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else f"CPU ({cpu_model()})"
    # The ranks' threads, not this process's: a demo's ranks ran with their share of the cores.
    threads = torch.get_num_threads() if torch.cuda.is_available() else cpu_threads_per_rank(ranks)
    env = environment([{"device": device, "threads": threads}] * ranks, load)
    if command:
        env["command"] = command
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_markdown(path, [f"# {title}", load.banner() if load else "", what, environment_markdown(env), *blocks])
