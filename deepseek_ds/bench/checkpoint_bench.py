"""`deepseek-ds bench checkpoint`: checkpoint save and load throughput next to a raw sequential write and read
of the same bytes on the same disk, as a printed table.

One process (world size 1) builds the real run from a run YAML, saves (synchronously, and with checkpoint.async: the
time the step is blocked, which is the save's own time plus its next update's wait for the state's copy, the next
training step running meanwhile, and the time until the files are durable and published) and resumes through
deepseek_ds.checkpoint (DeepSpeed's files, RNG, buffers, fsync, atomic publish), and writes and reads the very same
bytes with plain os.write/os.read. Page-cache pages of the files are dropped (posix_fadvise) before every read, and
every write is fsynced (each file, then its directory: the durability a save has), so both sides hit the disk; each
timed write starts with every earlier timed write's files deleted (_clear: this disk writes freed blocks several times
faster than others) and after the same flush and pause (_settle); the three writes take turns first in a round; each
row is the median of its rounds, a ratio the median of the rounds' own ratios. Every resume loads the first (untimed)
save's tag, every raw read its raw copy. Peak resident memory is sampled during each operation. The training step
that overlaps the async save is timed against the same step without a save (on this machine's 2 cores the copy and
the writer share the CPU with the step). A projection for DeepSeek-V3 (checkpoint_projection.py) follows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch.distributed as dist

from ..checkpoint.format import TAG
from ..checkpoint.resuming import resume
from ..checkpoint.saving import save
from ..config import load_and_validate
from ..data import micro_batches
from ..training.loop import train_step
from ..training.schedule import start_lr_schedule
from ..training.setup import build_run
from ..utils.cli_args import add_run_args, positive_int, spellings
from ..utils.errors import run_command
from ..utils.fmt import text_table
from ..utils.fs import fsync_dir
from ..utils.net import free_port
from .checkpoint_projection import projection_text, v3_checkpoint
from .load import HostLoad, add_allow_busy, check_quiet_host
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


def _raw_write(blobs: dict[str, bytes], out_dir: str) -> float:
    """The bytes of a tag's files, at the same relative paths under `out_dir`, each flushed, then the directories."""
    start = time.perf_counter()
    for rel, blob in blobs.items():
        path = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(blob)
            for off in range(0, len(view), _CHUNK):
                os.write(fd, view[off:off + _CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)
    for d, _, _ in os.walk(out_dir):  # the new names durable too, as a save's are
        fsync_dir(d)
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


def _clear(ckpt_dir: str, kept: str, raw_dir: str) -> None:
    """Before each timed write: every earlier timed write's files deleted (a run's retention deletes its old tags
    too). This disk (ext4 mounted with discard) writes into blocks just freed about five times faster than into
    others: so every write meets the same disk."""
    for name in os.listdir(ckpt_dir):
        if TAG.match(name) and name != os.path.basename(kept):
            shutil.rmtree(os.path.join(ckpt_dir, name))
    shutil.rmtree(raw_dir, ignore_errors=True)


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


def training_steps(run) -> Callable[[], None]:
    """A call: one optimizer step of the training loop's own (training.loop.train_step) on the run's next batch."""
    start_lr_schedule(run.engine)
    batches = micro_batches(run.dataset, run.sampler())
    return lambda: train_step(run, next(batches))


def run_checkpoint_bench(config: str, sets: list[str], deepspeed_config: str | None, repeats: int,
                         work_dir: str) -> list[dict]:
    """Rows of (operation, GB, seconds (the median of the rounds), GB/s, vs (the median of the rounds' ratios: the raw
    write's time over a save's; the blocked step's over the synchronous save's; the raw read's over the resume's; a
    step alone's over a step during the async save; None on the raw rows and the step alone), against (what `vs`
    compares with), peak_bytes (the largest resident memory over its start))."""
    single_process_env()
    sets = list(sets) + [f"train.output_dir={work_dir}/run", f"checkpoint.dir={work_dir}/ckpt",
                         f"checkpoint.keep={2 * repeats + 2}", "checkpoint.async=true"]
    cfg, ds = load_and_validate(config, deepspeed_config, sets, world_size=1)
    run = build_run(cfg, ds)
    times: dict[str, list[float]] = {k: [] for k in ("save", "blocked", "durable", "write", "load", "read", "step",
                                                     "step_saving")}
    peaks: dict[str, int] = dict.fromkeys(times, 0)
    blobs: dict[str, bytes] = {}  # the files of a checkpoint by path in its tag, for the raw rows
    # The raw writes go where a save's tag goes (a new directory in checkpoint.dir): the filesystem places both alike.
    read_dir, raw_dir = os.path.join(cfg.checkpoint_dir, ".raw-read"), os.path.join(cfg.checkpoint_dir, ".raw")
    step_once = training_steps(run)

    def timed_step() -> float:
        start = time.perf_counter()
        step_once()
        return time.perf_counter() - start

    def sync_save(step: int) -> None:
        with PeakRss() as rss:
            start = time.perf_counter()
            save(run, step, 0)
            times["save"].append(time.perf_counter() - start)
        peaks["save"] = max(peaks["save"], rss.extra)

    def async_save(step: int) -> None:
        """The save, then the training step it overlaps: the step is blocked by the save's own time and by its
        update's wait for the copy."""
        with PeakRss() as rss:
            start = time.perf_counter()
            save(run, step, 0, background=True)
            in_save = time.perf_counter() - start
            times["step_saving"].append(timed_step())
            times["blocked"].append(in_save + run.saver.update_wait_s)
            run.saver.wait()
            times["durable"].append(run.saver.durable_s)
        peaks["blocked"] = peaks["durable"] = max(peaks["durable"], rss.extra)

    def raw_write(step: int) -> None:
        times["write"].append(_raw_write(blobs, raw_dir))

    try:
        # An untimed step, then an untimed save: its bytes are what the raw rows write, its tag what every resume
        # loads. After the step, as in training: before its first step the optimizer holds no Adam moments yet
        # (a checkpoint of a third of the bytes).
        step_once()
        step = 1
        kept = save(run, step, 0)
        blobs.update({os.path.relpath(p, kept): Path(p).read_bytes() for p in _files(kept)})
        _raw_write(blobs, read_dir)  # untimed: the raw reads' files
        writes = [sync_save, raw_write, async_save]
        for i in range(repeats):
            for write in writes[i % 3:] + writes[:i % 3]:  # each write first in turn
                _clear(cfg.checkpoint_dir, kept, raw_dir)
                _settle()
                step += 1
                write(step)
            _clear(cfg.checkpoint_dir, kept, raw_dir)
            _evict(_files(kept))  # the tag resume loads
            with PeakRss() as rss:
                start = time.perf_counter()
                resume(run)
                times["load"].append(time.perf_counter() - start)
            peaks["load"] = max(peaks["load"], rss.extra)
            times["read"].append(_raw_read(_files(read_dir)))
            with PeakRss() as rss:
                times["step"].append(timed_step())  # the same step without a save: the async save's cost in it
            peaks["step"] = max(peaks["step"], rss.extra)
        gb = sum(len(b) for b in blobs.values()) / 1e9
        blobs.clear()
    finally:
        dist.destroy_process_group()

    median = {k: statistics.median(v) for k, v in times.items()}

    def vs(numerator: str, denominator: str) -> float:
        """The median of the rounds' own ratios: this disk's speed moves from one moment to the next, a round's
        operations are neighbours in time."""
        return statistics.median(n / d for n, d in zip(times[numerator], times[denominator]))

    rows = [("checkpoint save, synchronous (DeepSpeed + RNG + fsync + publish)", "save", vs("write", "save"),
             "raw write"),
            ("checkpoint save, checkpoint.async: the step blocked", "blocked", vs("blocked", "save"),
             "sync save (time)"),
            ("checkpoint save, checkpoint.async: durable and published", "durable", vs("write", "durable"),
             "raw write"),
            ("raw sequential write + fsync", "write", None, ""),
            ("checkpoint load (resume)", "load", vs("read", "load"), "raw read"),
            ("raw sequential read (cache dropped)", "read", None, ""),
            ("training step, an async save in flight", "step_saving", vs("step", "step_saving"), "step alone"),
            ("training step alone", "step", None, "")]
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
    if args.out:
        check_quiet_host(args.allow_busy)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp, HostLoad() as load:
        rows = run_checkpoint_bench(args.config, args.set, args.deepspeed_config, args.repeats, tmp)
    save_vs, resume_vs = rows[0]["vs"], rows[4]["vs"]  # the synchronous save's and the resume's against raw I/O
    text = "\n".join([format_table(rows), "", projection_text(v3_checkpoint(), save_vs, resume_vs)])
    print(text)
    if args.out:
        path = os.path.join(args.out, "checkpoint.md")
        write_process_report(path, "Checkpoint save and load vs raw disk I/O", (
            f"One process saves the run's model and optimizer synchronously and with checkpoint.async, writes the same "
            f"bytes raw, then resumes and reads the raw files back, {args.repeats} rounds. Raw: the files' bytes "
            "written sequentially with fsync of each file and its directory (a save's durability), read back with the "
            "page cache dropped first (posix_fadvise), on the same disk. Before each timed write every earlier timed "
            "write's files are deleted, as a run's retention deletes its old tags (this disk, ext4 with discard, "
            "writes into blocks just freed several times faster than into others), then the disk is flushed and left "
            "idle for a second; the three writes take turns first in a round, the raw one into a new directory beside "
            "the tags. A row is the median of its rounds, `vs` the median of the rounds' own ratios: of a save, the "
            "raw write's time over its; of the async save's step blocked (the save's own time plus the next update's "
            "wait for the state's copy, the step running meanwhile), its time over the synchronous save's; of the "
            "resume, the raw read's time over its. The training step with the async save in flight "
            "is compared with the same step alone (on 2 cores the copy and the writer take CPU from it). `peak "
            "memory`: the resident size above the operation's start (the async save holds a copy of the state until "
            "it is written; its row includes the overlapping step's). Then the arithmetic of a DeepSeek-V3 checkpoint "
            "at stated bandwidths."), ["```\n" + text + "\n```"], load=load)
        print(f"wrote {path}")
    return 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_args(p, config_required=False,
                 config_help="run YAML whose model is checkpointed (default: recipes/tiny-v3.yaml)",
                 set_help="run YAML override, e.g. --set model.overrides.hidden_size=1024 for a bigger checkpoint")
    p.set_defaults(config="recipes/tiny-v3.yaml")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed rounds, the writes taking turns first (3 or more: each once); the median is reported "
                   "(default 3)")
    p.add_argument(*spellings("--work-dir"), default=None,
                   help="directory on the disk to measure (default: the temp dir)")
    p.add_argument("--out", default=None, help="write the report OUT/checkpoint.md (default: print only)")
    add_allow_busy(p)
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
