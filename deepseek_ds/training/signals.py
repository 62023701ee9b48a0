"""Stopping on a signal at a step boundary, on every rank at once; ending a rank at once when it cannot get there."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..checkpoint.async_save import SAVE_FAILED
from .process import log_failure_to_file

# Signals this close to the first are the same request: the deepspeed runner sends SIGINT then SIGTERM, launch.py's
# handler re-enters on the second and signals every rank again, and a terminal's Ctrl-C reaches every process too.
REPEAT_GRACE_S = 2.0
# The launcher SIGKILLs a rank 30 s after its SIGTERM and only then signals the next one: a rank that has not
# reached a step boundary well before that, nor within STEP_FACTOR of its slowest step so far, is blocked in a
# collective that will not return (a peer hung or died).
STOP_DEADLINE_S = 20.0
STEP_FACTOR = 2.0
BUSY_POLL_S = 1.0
ABORT_STATUS = 1


class StopOnSignal:
    """SIGTERM (a scheduler's preemption; the deepspeed launcher forwards it) and SIGINT (Ctrl-C) set a flag. The
    training loop reduces `flag()` with every step's metrics and asks `requested()` after the step, so all ranks stop
    after the same step, save, and exit normally (a signal that arrives after a step's reduction stops the run after
    the next step).

    Python runs signal handlers only between bytecodes of the main thread, never while it waits in a collective, so
    a watcher thread reads the signals from the wakeup fd and ends the rank at once (one line, ABORT_STATUS, no save)
    on a second signal more than REPEAT_GRACE_S after the first, or when no step boundary is reached within
    `deadline_s` (or STEP_FACTOR x the slowest step) of the first. A context manager: the previous handlers come
    back on exit."""

    def __init__(self, device: torch.device, deadline_s: float = STOP_DEADLINE_S):
        self.device = device
        self.deadline_s = deadline_s
        self.received: str | None = None
        self._first_at: float | None = None  # when the watcher saw the first signal, and its name
        self._first_name = ""
        self._last_boundary: float | None = None
        self._slowest_step = 0.0
        self._at_boundary = threading.Event()  # requested() answered yes: the stop is under way
        self._done = threading.Event()
        self._busy = threading.Event()  # inside busy()
        self._busy_ended = 0.0

    def __enter__(self) -> StopOnSignal:
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)  # set_wakeup_fd requires it
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="stop-on-signal", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *_exc) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._done.set()
        self._writer.send(b"\0")  # wakes the watcher, which sees _done
        self._watcher.join()
        self._reader.close()
        self._writer.close()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Work between two step boundaries that is not a step (a periodic save, an evaluation): a first signal's
        deadline does not run during it, and counts from its end (the launcher's SIGKILL still bounds it)."""
        self._busy.set()
        try:
            yield
        finally:
            self._busy_ended = time.monotonic()
            self._busy.clear()

    @property
    def stopping(self) -> bool:
        """All ranks agreed to stop at a step boundary (requested() said yes)."""
        return self._at_boundary.is_set()

    def _handle(self, signum, _frame) -> None:
        self.received = signal.Signals(signum).name

    def flag(self, save_failed: bool = False) -> torch.Tensor:
        """This rank's request as a one-element float64 device tensor, for a MAX over ranks (the training loop's
        step metrics): made on the device, so no host-to-device copy (a blocking one syncs a GPU). 1: a signal;
        SAVE_FAILED (which outranks it) with `save_failed`: this rank's background save failed."""
        value = SAVE_FAILED if save_failed else 1.0 if self.received else 0.0
        return torch.full((1,), value, dtype=torch.float64, device=self.device)

    def requested(self, reduced: bool | None = None) -> bool:
        """At a step boundary: did any rank get a signal? `reduced`: flag() maxed over ranks and read already (the
        loop does it with the step's metrics); None: reduce and read it here (a collective)."""
        now = time.monotonic()
        if self._last_boundary is not None:
            self._slowest_step = max(self._slowest_step, now - self._last_boundary)
        self._last_boundary = now
        if reduced is None:
            flag = self.flag()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            reduced = bool(flag.item())
        if reduced:
            self._at_boundary.set()
        return reduced

    def _watch(self) -> None:
        while not self._done.is_set():
            bound = max(self.deadline_s, STEP_FACTOR * self._slowest_step)
            start = None if self._first_at is None else max(self._first_at, self._busy_ended)
            wait = None if start is None else start + bound - time.monotonic()
            if self._busy.is_set():  # a save or an evaluation: its own progress, not a hung step; look again later
                wait = BUSY_POLL_S
            elif wait is not None and wait <= 0:
                if not self._at_boundary.is_set():
                    _abort(f"no step boundary within {bound:.0f} s of {self._first_name} (a collective is hung: "
                           "has another rank stopped or died?)")
                wait = None  # saving: the launcher's own kill bounds it
            if not select.select([self._reader], [], [], wait)[0]:
                continue
            for signum in self._reader.recv(64):
                if signum not in (signal.SIGTERM, signal.SIGINT):
                    continue
                now = time.monotonic()
                if self._first_at is None:
                    self._first_at, self._first_name = now, signal.Signals(signum).name
                elif now - self._first_at > REPEAT_GRACE_S:
                    _abort(f"{signal.Signals(signum).name} {now - self._first_at:.0f} s after {self._first_name}")


def _abort(reason: str) -> None:
    """End this rank now, from the watcher thread: the main thread may be stuck in a collective for good."""
    line = f"deepseek-ds: rank {os.environ.get('RANK', 0)} exits at once, without saving: {reason}"
    print(line, file=sys.stderr, flush=True)
    log_failure_to_file(line)
    sys.stdout.flush()
    os._exit(ABORT_STATUS)
