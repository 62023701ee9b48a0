"""`deepseek-ds bench checkpoint`: checkpoint save and load throughput next to a raw sequential write and read
of the same bytes on the same disk, as a printed table.

One process (world size 1) builds the real run from a run YAML, saves and resumes through deepseek_ds.checkpoint
(DeepSpeed's files, RNG, buffers, fsync, atomic publish), then writes and reads the very same bytes with plain
os.write/os.read. Page-cache pages of the files are dropped (posix_fadvise) before every read, and every write is
fsynced (each file, then its directory: the durability a save has), so both sides hit the disk. The shared machine
is noisy, so "vs raw" is the median over rounds of each round's raw time over ours, measured one right after the
other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from ..checkpoint.resuming import resume
from ..checkpoint.saving import save
from ..config import load_and_validate
from ..training.setup import build_run
from ..utils.cli_args import add_run_args, spellings
from ..utils.errors import run_command
from ..utils.fmt import text_table
from ..utils.fs import fsync_dir
from ..utils.net import free_port
from .report import write_process_report

_CHUNK = 16 * 2**20


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _evict(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_write(blobs: list[bytes], out_dir: str) -> float:
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    for i, blob in enumerate(blobs):
        fd = os.open(os.path.join(out_dir, f"{i:05d}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(blob)
            for off in range(0, len(view), _CHUNK):
                os.write(fd, view[off:off + _CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(out_dir)  # the new names durable too, as a save's are
    return time.perf_counter() - start


def _raw_read(paths: list[str]) -> float:
    _evict(paths)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, _CHUNK):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - start


def single_process_env() -> None:
    """torch.distributed's env:// rendezvous for a world of one, unless a launcher already set it."""
    if "RANK" in os.environ:
        return
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})


def run_checkpoint_bench(config: str, sets: list[str], deepspeed_config: str | None, repeats: int,
                         work_dir: str) -> list[dict]:
    """Rows of (operation, GB, seconds (median of `repeats`), GB/s, vs raw (median of the rounds' raw time over
    this row's; 1 on the raw rows))."""
    single_process_env()
    sets = list(sets) + [f"train.output_dir={work_dir}/run", f"checkpoint.dir={work_dir}/ckpt",
                         f"checkpoint.keep={repeats + 1}"]
    cfg, ds = load_and_validate(config, deepspeed_config, sets, world_size=1)
    run = build_run(cfg, ds)
    try:
        saves, loads, raw_writes, raw_reads = [], [], [], []
        for i in range(1, repeats + 1):
            start = time.perf_counter()
            tag_dir = save(run, i, 0)
            saves.append(time.perf_counter() - start)
            paths = _files(tag_dir)
            _evict(paths)
            start = time.perf_counter()
            resume(run)
            loads.append(time.perf_counter() - start)
            blobs = [Path(p).read_bytes() for p in paths]
            raw_dir = os.path.join(work_dir, f"raw{i}")
            raw_writes.append(_raw_write(blobs, raw_dir))
            raw_reads.append(_raw_read(_files(raw_dir)))
        gb = sum(len(b) for b in blobs) / 1e9
    finally:
        dist.destroy_process_group()
    rows = [("checkpoint save (DeepSpeed + RNG + fsync + publish)", saves),
            ("raw sequential write + fsync", raw_writes),
            ("checkpoint load (resume)", loads),
            ("raw sequential read (cache dropped)", raw_reads)]
    out = []
    for i, (name, times) in enumerate(rows):
        raw = rows[i + 1][1] if i % 2 == 0 else times  # each checkpoint row is followed by its raw counterpart
        out.append({"operation": name, "GB": gb, "seconds": statistics.median(times),
                    "GB/s": gb / statistics.median(times),
                    "vs raw": statistics.median(r / t for r, t in zip(raw, times))})
    return out


def format_table(rows: list[dict]) -> str:
    cells = [[r["operation"], f"{r['GB']:.3f}", f"{r['seconds']:.3f}", f"{r['GB/s']:.2f}", f"{r['vs raw']:.2f}x"]
             for r in rows]
    return text_table(cells, ["operation", "GB", "seconds", "GB/s", "vs raw"])


def _bench(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        rows = run_checkpoint_bench(args.config, args.set, args.deepspeed_config, args.repeats, tmp)
    table = format_table(rows)
    print(table)
    if args.out:
        path = os.path.join(args.out, "checkpoint.md")
        write_process_report(path, "Checkpoint save and load vs raw disk I/O", (
            f"One process saves and resumes the run's model and optimizer {args.repeats} times (median; `vs raw` is "
            "the median over the rounds of the raw time over this one's). Raw: the same files' bytes written "
            "sequentially with fsync of each file and its directory (a save's durability), and read back with the "
            "page cache dropped first (posix_fadvise), on the same disk, back to back in each round."),
            ["```\n" + table + "\n```"])
        print(f"wrote {path}")
    return 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_args(p, config_required=False,
                 config_help="run YAML whose model is checkpointed (default: recipes/tiny-v3.yaml)",
                 set_help="run YAML override, e.g. --set model.overrides.hidden_size=1024 for a bigger checkpoint")
    p.set_defaults(config="recipes/tiny-v3.yaml")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default 3)")
    p.add_argument(*spellings("--work-dir"), default=None,
                   help="directory on the disk to measure (default: the temp dir)")
    p.add_argument("--out", default=None, help="write the report OUT/checkpoint.md (default: print only)")
    p.set_defaults(func=_bench)


def register(subparsers) -> None:
    """Add `checkpoint` to the `deepseek-ds bench` sub-command group."""
    _add_arguments(subparsers.add_parser("checkpoint", help="checkpoint save/load GB/s vs raw disk write/read"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepseek_ds.bench.checkpoint_bench", description=__doc__)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return run_command(lambda: _bench(args))


if __name__ == "__main__":
    sys.exit(main())
