"""Running the deepspeed launcher as a child that a scheduler's SIGTERM (or a Ctrl-C) really reaches.

On one host DeepSpeed's runner (`deepspeed ...`) installs no signal handler: SIGTERM kills it and leaves its
`launch.py` and every rank training on, orphaned. So `deepseek-ds train` does not exec it: it starts the runner in
a session of its own and passes TERM/INT/HUP on to what handles them: the runner's children (`launch.py`, which
signals every rank and SIGKILLs the ones still alive 30 s later) on one host, the runner itself across hosts (it then
stops the remote ranks through pdsh). The ranks finish their step, save it and write STOP_RECORD; launch.py still
exits 1 after any signal, so a fresh STOP_RECORD is what says that the job stopped cleanly. A CLI that cannot pass
anything on (kill -9) still takes the job with it: launcher/lifeline.py. A launch whose rendezvous is on this host
gets its port here too (rendezvous_port).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import psutil

from deepseek_ds.launcher.lifeline import runner_preexec, supervisor_env
from deepseek_ds.launcher.probe import port_free
from deepseek_ds.utils.errors import UserError
from deepseek_ds.utils.net import free_port

STOP_RECORD = "stopped.json"  # in train.output_dir: {"step", "signal", "checkpoint"}, written by rank 0 after the save
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def rendezvous_port(given: int | None) -> int:
    """The --master_port of a launch whose rendezvous (rank 0's TCPStore) is on this host: a free port when none is
    given (DeepSpeed's default, 29500, would collide with any other local job), else `given` once this host can bind
    it, refused in one line before anything starts (otherwise every rank dies with an EADDRINUSE traceback)."""
    if given is None:
        return free_port()
    bind = port_free(given)
    if not bind["free"]:
        raise UserError(f"--master_port {given} cannot be used on this host: {bind['error']} (another job's "
                        "rendezvous?)", "leave --master_port out to take a free port, or give another")
    return given


def run_launcher(argv: list[str], multi_host: bool) -> tuple[int, str | None]:
    """Run the deepspeed runner `argv` to its end; returns (its exit status as a shell reports it, 128 + N for a
    death by signal N; the first signal passed on or None). multi_host: DeepSpeed's multi-node mode (more than one
    host), where the runner itself handles signals."""
    proc = subprocess.Popen(argv, start_new_session=True,  # a terminal's Ctrl-C reaches us only, once
                            env=supervisor_env(os.environ), preexec_fn=runner_preexec())
    received: list[str] = []

    def forward(signum, _frame) -> None:
        received.append(signal.Signals(signum).name)
        # launch.py and the runner handle TERM and INT only: a HUP would kill them and orphan the ranks.
        sig = signal.SIGTERM if signum == signal.SIGHUP else signum
        if proc.poll() is not None:  # the runner is gone; what is left of its session gets the signal directly
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            return
        with contextlib.suppress(psutil.Error):
            for target in [psutil.Process(proc.pid)] if multi_host else psutil.Process(proc.pid).children():
                target.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        status = proc.wait()
        _wait_for_session(proc.pid)  # the runner can end before launch.py has stopped the ranks
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return (status if status >= 0 else 128 - status), (received[0] if received else None)


def _wait_for_session(sid: int, poll_s: float = 0.2) -> None:
    """Until no process of the runner's session is left (launch.py bounds it: SIGKILL 30 s after SIGTERM; a signal
    meanwhile reaches the session's process group, see forward)."""
    def members() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if os.getsid(p.pid) == sid:
                    found.append(p)
        return found

    while members():
        time.sleep(poll_s)


def read_stop_record(output_dir: str, since: float) -> dict | None:
    """The ranks' record of a clean stop on a signal, if written after `since` (time.time())."""
    path = os.path.join(output_dir, STOP_RECORD)
    with contextlib.suppress(OSError, ValueError):
        if os.path.getmtime(path) >= since:
            with open(path) as f:
                return json.load(f)
    return None
