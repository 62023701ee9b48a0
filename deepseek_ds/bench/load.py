"""How busy the host is, for every benchmark: a check before any process of it starts (a report measured on a host
busier than its cores times the other work; --allow-busy to write it anyway), and the load while it runs, sampled
and stated in the report. Light on imports: `bench data` measures before it imports torch or DeepSpeed."""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time

import psutil

from ..utils.cli_args import spellings
from ..utils.errors import UserError


def add_allow_busy(p: argparse.ArgumentParser) -> None:
    p.add_argument(*spellings("--allow-busy"), action="store_true",
                   help="write the report even when the host is busier than its cores before the run (the last "
                        "minute's load average and the tasks runnable now both above the core count); the report's "
                        "header then says so (default: refuse)")


def host_cores() -> int:
    """What the load is compared with: the load average and the runnable tasks count the whole host, so all its
    cores (the affinity mask's usable cores would call a big shared host busy for work on cores we never use)."""
    return os.cpu_count() or 1


def runnable_tasks() -> int | None:
    """Tasks runnable on the host at this instant, less the one reading (Linux's procs_running); None where
    /proc/stat has no such count. Unlike the load average it does not remember the last minute."""
    try:
        with open("/proc/stat") as f:
            line = next((row for row in f if row.startswith("procs_running ")), None)
    except OSError:
        return None
    return None if line is None else max(0, int(line.split()[1]) - 1)


def runnable_now(reads: int = 5, gap_s: float = 0.1) -> float | None:
    """The median of a few runnable_tasks() reads: one read catches a passing burst."""
    counts = []
    for i in range(reads):
        counts.append(runnable_tasks())
        if counts[-1] is None:
            return None
        if i < reads - 1:
            time.sleep(gap_s)
    return statistics.median(counts)


def busier_than(load: float, runnable: float | None, bar: float) -> bool:
    """Over the last minute (the load average) and now (the runnable tasks, where the OS counts them): a minute's
    average alone still counts a benchmark that has just ended on a host now quiet."""
    return load > bar and (runnable is None or runnable > bar)


def check_quiet_host(allow_busy: bool) -> None:
    """Before any process of a benchmark starts: refuse to measure for a report on a host busier than its cores
    (the rows would time the other work), unless `allow_busy`."""
    load, runnable, cores = os.getloadavg()[0], runnable_now(), host_cores()
    if busier_than(load, runnable, cores) and not allow_busy:
        now = "" if runnable is None else f" and {runnable:g} tasks runnable now"
        raise UserError(f"this host is busy: load average {load:.1f} over the last minute{now} on {cores} cores, so "
                        "a report written now would time the other work as much as the benchmark",
                        hint="run it on a quiet host, or pass --allow-busy to write the report anyway (its header "
                             "then says the host was busy)")


class HostLoad:
    """How busy this host was while a benchmark ran: the load average (1 minute) and the runnable tasks when it
    began and, sampled every `interval` seconds, while it ran; and the share of the cores that work other than the
    benchmark's launches used: the host's busy CPU time minus the launches' (the launcher, launch.py and the ranks
    are waited-for descendants, so their CPU time lands in RUSAGE_CHILDREN). `own_tasks`: the most threads the
    benchmark's own ranks run at once (ranks x threads), a load it causes itself; one more task is allowed for the
    launcher and this driver."""

    def __init__(self, interval: float = 5.0, own_tasks: int = 0):
        self.interval, self.own_tasks = interval, own_tasks
        self.samples: list[float] = []                 # load averages while it ran
        self.runnable: list[int | None] = []           # runnable tasks at the same instants
        self._stop = threading.Event()

    def __enter__(self) -> HostLoad:
        self.before, self.before_runnable = os.getloadavg()[0], runnable_now()
        self._start = (time.monotonic(), self._busy(), self._children())
        self._sampler = threading.Thread(target=self._sample, name="host-load", daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def _take(self) -> None:
        self.samples.append(os.getloadavg()[0])
        self.runnable.append(runnable_tasks())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sampler.join()
        self._take()
        wall, busy, children = (now - then for now, then in zip(
            (time.monotonic(), self._busy(), self._children()), self._start))
        self.other_share = max(0.0, busy - children) / (max(wall, 1e-9) * psutil.cpu_count())

    def _runnable_median(self) -> float | None:
        counts = [n for n in self.runnable if n is not None]
        return statistics.median(counts) if counts else None

    @property
    def busy(self) -> bool:
        """Busier than its cores: before the run, or during it (the median sample) beyond what the benchmark's own
        ranks run (a benchmark that puts more threads than cores on the host by design is not called busy for
        that)."""
        cores = host_cores()
        during = busier_than(statistics.median(self.samples), self._runnable_median(),
                             max(cores, self.own_tasks) + 1)
        return busier_than(self.before, self.before_runnable, cores) or during

    def describe(self) -> str:
        runnable = self._runnable_median()
        return (f"load average {self.before:.1f} before"
                + ("" if self.before_runnable is None else f" ({self.before_runnable:g} tasks runnable)")
                + f", {statistics.median(self.samples):.1f} median and {max(self.samples):.1f} max during"
                + ("" if runnable is None else f" ({runnable:g} tasks runnable, median)")
                + f" ({len(self.samples)} samples, every {self.interval:g} s) on {host_cores()} cores; other work "
                f"used {self.other_share:.0%} of the cores")

    def banner(self) -> str:
        """The warning at the top of a report from a busy host ("" from a quiet one)."""
        if not self.busy:
            return ""
        return (f"> **Measured on a busy host** ({self.describe()}): other work competed for the cores, so the "
                "times below are slower and noisier than this host can do, and the rows may not compare. "
                "Rerun on a quiet host before drawing conclusions.")

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _children() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime
