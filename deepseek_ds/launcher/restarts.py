"""`deepseek-ds train --max-restarts N`: a job that failed is started again, unattended, and resumes from its newest
complete checkpoint (what any launch of the same run does), at most N times.

Each attempt runs to the end of its whole session (run_launcher waits for every process of it), so a restart never
runs beside a process of an earlier attempt. Not restarted: a signal to `deepseek-ds train` (a person or the
scheduler stopping the job, during an attempt or its back-off), and the ranks' own verdicts that a rerun would
repeat (training/main.py's exit statuses: 2 for a run that does not fit its data or checkpoint, 3 for a non-finite
loss). A failure after which the newest checkpoint is no newer than after the previous one made no progress: a
restart would only repeat it, so the restarts stop there.

Each restart is one line on the console and one record in the run's metrics.jsonl, {"event": "restart", "step": the
step it resumes from, ...}: training/metrics.py keeps such records across resumes and leaves them out of the loss
records, so plots and reports read only steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from deepseek_ds.launcher.supervise import FORWARDED, run_launcher
from deepseek_ds.utils.cli_args import non_negative_float, non_negative_int, spellings
from deepseek_ds.utils.fs import write_bytes_atomic

RESTART_EVENT = "restart"
BACKOFF_S = 5.0
# A rank's exit status (training/main.py) that says a rerun would fail the same way: the launcher passes it on.
NOT_RESTARTED = {2: "the run does not fit its data, checkpoint or configuration (the ranks' error line says why)",
                 3: "training stopped on non-finite losses (the ranks' line says why)"}


class NoRestart(Exception):
    """Raised by a restart's command: the job cannot be started again (the reason, one line)."""


@dataclasses.dataclass(frozen=True)
class Attempt:
    """A restart's launcher command, and what its record in metrics.jsonl adds (launcher/elastic.py: the hosts it
    leaves out)."""

    argv: list[str]
    note: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far the run got: the step of its newest complete checkpoint and the last step in its metrics.jsonl
    (0: none)."""

    checkpoint_step: int
    logged_step: int


def add_restart_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(*spellings("--max-restarts"), dest="max_restarts", type=non_negative_int, default=0, metavar="N",
                   help="after a failure (a rank killed, a hang past train.dist_timeout_s), start the job again, "
                        "resuming from its newest checkpoint, at most N times (default: 0, never)")
    p.add_argument("--elastic", action="store_true",
                   help="with --hostfile and --max-restarts: before a restart, leave out the hosts that cannot be "
                        "reached (as --exclude) if the run's layout fits the ranks left; without it a lost host "
                        "ends the restarts")
    p.add_argument(*spellings("--restart-backoff"), dest="restart_backoff", type=non_negative_float,
                   default=BACKOFF_S, metavar="SECONDS",
                   help=f"seconds to wait before each restart (default: {BACKOFF_S:g})")


def describe(status: int) -> str:
    """A failed launch's exit status in words. launch.py exits with a failed rank's status, sys.exit(-N) (256 - N)
    for a rank killed by signal N; run_launcher reports 128 + N for a runner killed by signal N."""
    if status in NOT_RESTARTED:
        return f"exit status {status}: {NOT_RESTARTED[status]}"
    if status > 128:
        number, who = (256 - status, "a rank") if status > 192 else (status - 128, "the launcher")
        with contextlib.suppress(ValueError):
            return f"{who} was killed by {signal.Signals(number).name} (exit status {status})"
    return f"a rank failed (exit status {status})"


def run_with_restarts(argv: list[str], command: Callable[[], Attempt], multi_host: bool, max_restarts: int,
                      backoff_s: float, progress: Callable[[], Progress], metrics_path: str,
                      say: Callable[[str], None] = lambda line: print(line, flush=True)) -> tuple[int, str | None, float]:
    """Run the launcher `argv`, and after a failure `command()` (the same job, its rendezvous port fresh if it was
    not given; with --elastic without the hosts that are gone; NoRestart: none) up to `max_restarts` times; returns
    the last attempt's (exit status, signal passed on or None, start time). With max_restarts 0 this is one
    run_launcher, nothing printed."""
    restarts, previous = 0, None
    while True:
        started = time.time()
        status, signal_name = run_launcher(argv, multi_host)
        if status == 0 or signal_name is not None or max_restarts == 0:
            return status, signal_name, started
        cause, now = describe(status), progress()
        if status in NOT_RESTARTED:
            say(f"deepseek-ds: not restarted: {cause}")
            return status, None, started
        if restarts == max_restarts:
            say(f"deepseek-ds: not restarted: {cause} {_at(now.logged_step)}, and --max-restarts {max_restarts} are "
                "used up")
            return status, None, started
        if previous is not None and now.checkpoint_step <= previous.checkpoint_step:
            say(f"deepseek-ds: not restarted: {cause} {_at(now.logged_step)} again, with no checkpoint newer than "
                f"step {now.checkpoint_step} since the previous failure: a restart would repeat it")
            return status, None, started
        restarts, previous = restarts + 1, now
        lost = max(0, now.logged_step - now.checkpoint_step)
        resume = f"resuming from step {now.checkpoint_step}" if now.checkpoint_step else "starting over (no checkpoint)"
        say(f"deepseek-ds: restart {restarts} of {max_restarts} in {backoff_s:g} s: {cause} {_at(now.logged_step)}; "
            f"{resume} ({lost} step{'' if lost == 1 else 's'} lost)")
        stopped_by = _back_off(backoff_s)
        if stopped_by is not None:
            say(f"deepseek-ds: not restarted: {stopped_by} during the back-off")
            return status, None, started
        try:
            attempt = command()
        except NoRestart as e:
            say(f"deepseek-ds: not restarted: {e}")
            return status, None, started
        append_record(metrics_path, {"event": RESTART_EVENT, "step": now.checkpoint_step, "restart": restarts,
                                     "max_restarts": max_restarts, "cause": cause, "exit_status": status,
                                     "failed_after_step": now.logged_step, "steps_lost": lost, "time": time.time(),
                                     **attempt.note})
        argv = attempt.argv
        say(" ".join(argv))


def _at(step: int) -> str:
    return f"at step {step}" if step else "before the first step"


def _back_off(seconds: float) -> str | None:
    """Wait `seconds`; a signal meant for the job ends the wait and the restarts: returns its name (None: waited)."""
    received: list[str] = []
    woken = threading.Event()

    def stop(signum, _frame) -> None:
        received.append(signal.Signals(signum).name)
        woken.set()

    previous = {sig: signal.signal(sig, stop) for sig in FORWARDED}
    try:
        woken.wait(seconds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received[0] if received else None


def append_record(path: str, record: dict) -> None:
    """Add `record` to a metrics.jsonl (nothing if the run never got to write one). A last line that the kill cut
    short is dropped first, as read_metrics drops it: mid-file it would read as damage."""
    if not os.path.isfile(path):
        return
    head, _, tail = Path(path).read_bytes().rpartition(b"\n")
    kept = head + b"\n" if head else b""
    with contextlib.suppress(ValueError):  # a whole record that only lost its newline is kept
        json.loads(tail)
        kept += tail + b"\n"
    write_bytes_atomic(Path(path), kept + (json.dumps(record) + "\n").encode())
