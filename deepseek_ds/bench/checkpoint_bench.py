"""`deepseek-ds bench checkpoint`: checkpoint save and load throughput next to a raw sequential write and read
of the same bytes on the same disk, as a printed table.

One process (world size 1) builds the real run from a run YAML, saves (synchronously, and with checkpoint.async: the
time the step is blocked and the time until the files are durable and published) and resumes through
deepseek_ds.checkpoint (DeepSpeed's files, RNG, buffers, fsync, atomic publish), and writes and reads the very same
bytes with plain os.write/os.read. Page-cache pages of the files are dropped (posix_fadvise) before every read, and
every write is fsynced (each file, then its directory: the durability a save has), so both sides hit the disk; each
timed write starts after the same flush and pause (_settle). The three writes take turns in each round's first slot
(after the previous round's reads, where a save after training steps is too): on this cloud disk a write right after
another runs several times slower, so each write row is the median of its first-slot rounds. Peak resident memory is
sampled during each operation; a projection for DeepSeek-V3 (checkpoint_projection.py) follows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch.distributed as dist

from ..checkpoint.resuming import resume
from ..checkpoint.saving import save
from ..config import load_and_validate
from ..training.setup import build_run
from ..utils.cli_args import add_run_args, positive_int, spellings
from ..utils.errors import run_command
from ..utils.fmt import text_table
from ..utils.fs import fsync_dir
from ..utils.net import free_port
from .checkpoint_projection import projection_text, v3_checkpoint
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


SETTLE_S = 1.0


def _settle() -> None:
    """Before each timed write: the earlier writes flushed, then a pause. A cloud disk writes a burst faster after
    an idle moment than under sustained writing; every write row starts from the same state."""
    os.sync()
    time.sleep(SETTLE_S)


class PeakRss:
    """The peak resident memory of this process over its value at entry, sampled every POLL_S in a thread."""

    POLL_S = 0.002

    def __enter__(self) -> PeakRss:
        self._proc = psutil.Process()
        self.start = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.POLL_S):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.start


def run_checkpoint_bench(config: str, sets: list[str], deepspeed_config: str | None, repeats: int,
                         work_dir: str) -> list[dict]:
    """Rows of (operation, GB, seconds (median: a write's over its first-slot rounds), GB/s, vs (the raw write's
    median over ours; the blocked step's over the synchronous save's; the median of the rounds' raw read over resume
    ratios; None on the raw rows), against (what `vs` compares with), peak_bytes (the largest resident memory over
    its start))."""
    single_process_env()
    sets = list(sets) + [f"train.output_dir={work_dir}/run", f"checkpoint.dir={work_dir}/ckpt",
                         f"checkpoint.keep={2 * repeats + 2}", "checkpoint.async=true"]
    cfg, ds = load_and_validate(config, deepspeed_config, sets, world_size=1)
    run = build_run(cfg, ds)
    times: dict[str, list[float]] = {k: [] for k in ("save", "blocked", "durable", "write", "load", "read")}
    first: dict[str, list[float]] = {k: [] for k in ("save", "durable", "write")}  # times in the first slot
    peaks: dict[str, int] = dict.fromkeys(times, 0)
    blobs: list[bytes] = []  # the bytes of a checkpoint, for the raw rows

    def sync_save(step: int, raw_dir: str) -> tuple[str, float]:
        with PeakRss() as rss:
            start = time.perf_counter()
            tag_dir = save(run, step, 0)
            times["save"].append(time.perf_counter() - start)
        peaks["save"] = max(peaks["save"], rss.extra)
        return tag_dir, times["save"][-1]

    def async_save(step: int, raw_dir: str) -> tuple[str, float]:
        with PeakRss() as rss:
            start = time.perf_counter()
            tag_dir = save(run, step, 0, background=True)
            times["blocked"].append(time.perf_counter() - start)
            run.saver.wait()
            times["durable"].append(run.saver.durable_s)
        peaks["blocked"] = peaks["durable"] = max(peaks["durable"], rss.extra)
        return tag_dir, times["durable"][-1]

    def raw_write(step: int, raw_dir: str) -> tuple[None, float]:
        times["write"].append(_raw_write(blobs, raw_dir))
        return None, times["write"][-1]

    try:
        step = 1  # an untimed first save: its files are the bytes the raw rows write and read
        newest = save(run, step, 0)
        blobs += [Path(p).read_bytes() for p in _files(newest)]
        writes = [("save", sync_save), ("write", raw_write), ("durable", async_save)]
        for i in range(repeats):
            raw_dir = os.path.join(work_dir, f"raw{i}")
            # The writes take turns in the first slot, the one after the previous round's reads: on this cloud disk
            # a write that follows reads runs several times faster than one that follows a write, and a save after
            # training steps follows no write either. The write rows compare their first-slot rounds.
            for slot, (key, write) in enumerate(writes[i % 3:] + writes[:i % 3]):
                _settle()
                step += 1
                tag_dir, seconds = write(step, raw_dir)
                newest = tag_dir or newest
                if slot == 0:
                    first[key].append(seconds)
            _evict(_files(newest))  # the tag resume loads
            with PeakRss() as rss:
                start = time.perf_counter()
                resume(run)
                times["load"].append(time.perf_counter() - start)
            peaks["load"] = max(peaks["load"], rss.extra)
            times["read"].append(_raw_read(_files(raw_dir)))
        gb = sum(len(b) for b in blobs) / 1e9
        blobs.clear()
    finally:
        dist.destroy_process_group()

    if repeats < len(first):
        print(f"--repeats {repeats}: not every write had a first-slot round; its row takes all of its rounds")
    median = {k: statistics.median(v) for k, v in times.items()} | {
        k: statistics.median(v) for k, v in first.items() if v}
    resume_vs = statistics.median(r / o for o, r in zip(times["load"], times["read"]))  # the same round's
    rows = [("checkpoint save, synchronous (DeepSpeed + RNG + fsync + publish)", "save",
             median["write"] / median["save"], "raw write"),
            ("checkpoint save, checkpoint.async: the step blocked", "blocked", median["blocked"] / median["save"],
             "sync save (time)"),
            ("checkpoint save, checkpoint.async: durable and published", "durable",
             median["write"] / median["durable"], "raw write"),
            ("raw sequential write + fsync", "write", None, ""),
            ("checkpoint load (resume)", "load", resume_vs, "raw read"),
            ("raw sequential read (cache dropped)", "read", None, "")]
    return [{"operation": name, "GB": gb, "seconds": median[key], "GB/s": gb / median[key], "vs": vs,
             "against": against, "peak_bytes": peaks[key]} for name, key, vs, against in rows]


def format_table(rows: list[dict]) -> str:
    """`vs`: raw time over ours (>= 1: faster than the raw I/O), or for the blocked step its time over the
    synchronous save's (the share of a save the step still waits for); `peak memory`: the process's largest
    resident size over its start during the operation (raw rows: not measured)."""
    def vs(r):
        return "-" if r["vs"] is None else f"{r['vs']:.2f}x {r['against']}"

    cells = [[r["operation"], f"{r['GB']:.3f}", f"{r['seconds']:.3f}", f"{r['GB/s']:.2f}", vs(r),
              f"{r['peak_bytes'] / 2**20:,.0f} MiB" if r["peak_bytes"] else "-"] for r in rows]
    return text_table(cells, ["operation", "GB", "seconds", "GB/s", "vs", "peak memory"])


def _bench(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        rows = run_checkpoint_bench(args.config, args.set, args.deepspeed_config, args.repeats, tmp)
    save_vs, resume_vs = rows[0]["vs"], rows[4]["vs"]  # the synchronous save's and the resume's against raw I/O
    text = "\n".join([format_table(rows), "", projection_text(v3_checkpoint(), save_vs, resume_vs)])
    print(text)
    if args.out:
        path = os.path.join(args.out, "checkpoint.md")
        write_process_report(path, "Checkpoint save and load vs raw disk I/O", (
            f"One process saves the run's model and optimizer synchronously and with checkpoint.async, writes the same "
            f"bytes raw, then resumes from the newest tag and reads the raw files back, {args.repeats} rounds. Raw: "
            "the files' bytes written sequentially with fsync of each file and its directory (a save's durability), "
            "read back with the page cache dropped first (posix_fadvise), on the same disk. The three writes take "
            "turns in each round's first slot, after the previous round's reads (as a save after training steps "
            "follows no write): on this disk a write right after another ran several times slower. A write row is the "
            "median of its first-slot rounds, `vs` the raw write's over it; the blocked step is over the synchronous "
            "save's; the resume's `vs` is the median of the rounds' own ratios. `peak memory`: the resident size above the operation's "
            "start (the async save holds a copy of the state until it is written). Then the arithmetic of a "
            "DeepSeek-V3 checkpoint at stated bandwidths."), ["```\n" + text + "\n```"])
        print(f"wrote {path}")
    return 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_args(p, config_required=False,
                 config_help="run YAML whose model is checkpointed (default: recipes/tiny-v3.yaml)",
                 set_help="run YAML override, e.g. --set model.overrides.hidden_size=1024 for a bigger checkpoint")
    p.set_defaults(config="recipes/tiny-v3.yaml")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed rounds, the writes taking turns in the first slot (3 or more: each once); the median "
                   "is reported (default 3)")
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
