"""A job ends with the process that started it, however that process ends (kill -9 included).

`deepseek-ds train` starts DeepSpeed's runner in a session of its own (launcher/supervise.py says why), so a kill -9
of the CLI's process group reaches the CLI only, and DeepSpeed's runner, launch.py and ranks have no way to notice:
they trained on as orphans. One rule, "stop when what started you is gone", in the two places we control:
  - the runner: a parent-death signal (Linux prctl PR_SET_PDEATHSIG: SIGTERM when the CLI dies), armed in the child
    between fork and exec (`runner_preexec`). On one host it kills the runner (it has no handler); across hosts its
    handler stops pdsh and runs DeepSpeed's kill command (pkill of launch.py on every host), and each launch.py stops
    its ranks.
  - every rank: a watchdog thread (`Lifeline`) polling the CLI (its pid, from SUPERVISOR_ENV, watched only on the
    CLI's own host and pid namespace; launch.py is not ours, so the ranks on the CLI's host must see the CLI go) and
    the rank's parent (launch.py: what a remote rank has; a parent that dies re-parents the rank). When either is
    gone it sends the rank SIGTERM (the ranks stop at a step boundary and save, training/signals.py), then a kernel
    timer SIGKILLs it STOP_GRACE_S later (a cut save leaves the previous checkpoint valid). When its ranks end,
    launch.py exits, and with it the runner.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping

import psutil

SUPERVISOR_ENV = "DEEPSEEK_DS_SUPERVISOR"  # "<pid> <pid space>" of `deepseek-ds train`, set for the runner's tree
POLL_S = 0.5
# SIGTERM, then SIGKILL this much later: kill -9 of the CLI takes the whole job down within ~10 s (issue 46: 15 s),
# DeepSpeed's launch.py (polls every 1 s) and its exit included. A save that takes longer is cut short.
STOP_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def pid_space() -> str:
    """Which pids this process can name: the boot (a fresh id per host and boot) and the pid namespace. A pid from
    another host or container (an environment that srun or mpirun carried over) means nothing here."""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    return socket.gethostname()


def supervisor_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for the runner: its tree (launch.py, the ranks of this host) learns who started the job."""
    return {**environ, SUPERVISOR_ENV: f"{os.getpid()} {pid_space()}"}


def runner_preexec() -> Callable[[], None] | None:
    """A Popen preexec_fn that gives the child SIGTERM when this process dies (None off Linux). prctl is looked up
    here, in the parent: the child between fork and exec should do as little as possible. The flag survives exec
    (not of a setuid binary) and fires on the death of the thread that forked, so call Popen from the main thread."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before the flag was set: it will never fire
            os._exit(128 + signal.SIGTERM)
    return arm


def _supervisor(environ: Mapping[str, str]) -> tuple[int | None, psutil.Process | None]:
    """(pid, process) of SUPERVISOR_ENV if it can be watched from here, else (None, None); the process is None when
    it was gone already. A psutil.Process also notices its pid reused by another process (it compares start times)."""
    pid, _, space = environ.get(SUPERVISOR_ENV, "").partition(" ")
    if not pid.isdigit() or space != pid_space():
        return None, None
    try:
        return int(pid), psutil.Process(int(pid))
    except psutil.NoSuchProcess:
        return int(pid), None


def _alive(proc: psutil.Process | None) -> bool:
    try:  # a killed CLI stays a zombie until its own parent reaps it
        return proc is not None and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Sigevent(ctypes.Structure):  # Linux: 64 bytes, the notify-thread fields unused with SIGEV_SIGNAL (0)
    _fields_ = [("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int), ("sigev_notify", ctypes.c_int),
                ("_rest", ctypes.c_int * 12)]


def _kernel_sigkill_in(seconds: float) -> bool:
    """Have the kernel SIGKILL this process `seconds` from now (a POSIX timer): unlike a Python thread, it fires also
    while the interpreter shuts down (torch's and gloo's teardown can take seconds). False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    for library in (None, "librt.so.1"):  # glibc before 2.34 keeps the timers in librt
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(library, use_errno=True)
            create, settime = lib.timer_create, lib.timer_settime
            break
    else:
        return False
    timer = ctypes.c_void_p()
    event = _Sigevent(sigev_signo=signal.SIGKILL, sigev_notify=0)  # SIGEV_SIGNAL
    if create(time.CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        return False
    whole = int(seconds)
    due = _Itimerspec(it_value=_Timespec(whole, int((seconds - whole) * 1e9)))
    return settime(timer, 0, ctypes.byref(due), None) == 0


class Lifeline:
    """A context manager around a rank's life: a thread that ends the process (SIGTERM, then SIGKILL `grace_s`
    later) when `deepseek-ds train` (SUPERVISOR_ENV, same pid space only) or the parent the process had at entry is
    gone; `say` gets one line saying so. The thread stops on exit; a SIGKILL once due stands."""

    def __init__(self, say: Callable[[str], None], environ: Mapping[str, str] = os.environ,
                 poll_s: float = POLL_S, grace_s: float = STOP_GRACE_S):
        self.say = say
        self.environ = environ
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._done = threading.Event()

    def __enter__(self) -> Lifeline:
        parent = os.getppid()
        # Parent 0 or 1 at entry: started by init itself (a container's entry point), nothing to watch.
        self._parent = parent if parent > 1 else None
        self._supervisor_pid, self._supervisor = _supervisor(self.environ)
        self._thread = threading.Thread(target=self._watch, name="lifeline", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._done.set()
        self._thread.join()

    def _gone(self) -> str | None:
        if self._supervisor_pid is not None and not _alive(self._supervisor):
            return f"`deepseek-ds train` (pid {self._supervisor_pid}) is gone"
        if self._parent is not None and os.getppid() != self._parent:
            return f"its launcher (pid {self._parent}) is gone"
        return None

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            reason = self._gone()
            if reason is None:
                continue
            with contextlib.suppress(OSError):  # the console may have died with the CLI: stop all the same
                self.say(f"deepseek-ds: rank {self.environ.get('RANK', 0)} stops: {reason} (SIGTERM now, SIGKILL "
                         f"in {self.grace_s:g} s)")
            timed = _kernel_sigkill_in(self.grace_s)
            os.kill(os.getpid(), signal.SIGTERM)  # the ranks stop at a step boundary, save, and end
            if not timed and not self._done.wait(self.grace_s):
                os.kill(os.getpid(), signal.SIGKILL)
            return
