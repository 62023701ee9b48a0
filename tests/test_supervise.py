"""`deepseek-ds train`'s hold on the launcher (launcher/supervise.py), with stand-ins for DeepSpeed's processes: a
runner without signal handlers (as DeepSpeed's is on one host) over a launch.py that handles TERM only; and the job's
end with the CLI's (launcher/lifeline.py: kill -9 of the CLI; a remote rank whose launch.py dies). The same through
the real launcher: tests/test_job_lifeline.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from deepseek_ds.launcher.lifeline import SUPERVISOR_ENV
from deepseek_ds.launcher.supervise import run_launcher

pytestmark = pytest.mark.unit

LAUNCH = """
import signal, sys, time
def stop(signum, _frame):
    open(sys.argv[1] + "/got", "w").write(signal.Signals(signum).name)
    sys.exit(1)  # launch.py exits 1 after any signal
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open(sys.argv[1] + "/ready", "w").close()
time.sleep(60)
"""
RUNNER = """
import subprocess, sys
sys.exit(subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]]).wait())
"""


def _signal_when_ready(tmp_path, signum) -> None:
    def send():  # once the stand-in's handlers are set, never at a deadline (a slow start would get the signal early)
        while not (tmp_path / "ready").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signum)
    threading.Thread(target=send, daemon=True).start()


@pytest.mark.parametrize("sent, delivered", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT"),
                                             (signal.SIGHUP, "SIGTERM")])  # launch.py has no HUP handler
def test_a_signal_reaches_launch_py_and_not_the_runner(tmp_path, sent, delivered):
    _signal_when_ready(tmp_path, sent)
    status, received = run_launcher([sys.executable, "-c", RUNNER, str(tmp_path), LAUNCH], multi_host=False)
    assert (status, received) == (1, signal.Signals(sent).name)  # the runner outlived it and reported launch.py's 1
    assert (tmp_path / "got").read_text() == delivered


def test_a_runner_killed_by_a_signal_reports_128_plus_its_number(tmp_path):
    status, received = run_launcher([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                                    multi_host=False)
    assert (status, received) == (128 + signal.SIGKILL, None)


# kill -9 of `deepseek-ds train`'s process group: stand-ins for the CLI (run_launcher itself), a runner that records
# the SIGTERM its parent-death signal brings, a launch.py that ends its ranks and exits when one fails (DeepSpeed's
# does both), and ranks that arm the Lifeline as training/main.py does; every argv carries the test's directory.
CLI = """
import sys
from deepseek_ds.launcher.supervise import run_launcher
run_launcher(sys.argv[1:], multi_host=False)
"""
RECORDING_RUNNER = """
import os, signal, subprocess, sys
def record(signum, _frame):
    open(sys.argv[1] + "/runner_got", "w").write(signal.Signals(signum).name)
    os._exit(128 + signum)
signal.signal(signal.SIGTERM, record)
sys.exit(subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[1:]]).wait())
"""
RANKS_LAUNCH = """
import signal, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1], str(r)]) for r in range(2)]
def stop(_signum, _frame):
    for r in ranks:
        r.terminate()
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
while any(r.poll() is None for r in ranks):
    if any(r.returncode for r in ranks):
        stop(signal.SIGTERM, None)
    time.sleep(0.2)
"""
# Rank 1 ignores SIGTERM, as a rank stuck in a collective or a long save would not end on it: SIGKILL ends it.
# Each poll of a rank's watch leaves a file rank<R>.poll<N>, so that a test waits for polls, not for seconds.
RANK = """
import signal, sys, time
from deepseek_ds.launcher.lifeline import Lifeline
class Counted(Lifeline):
    polls = 0
    def _gone(self):
        gone = super()._gone()
        Counted.polls += 1
        open(f"{sys.argv[1]}/rank{sys.argv[2]}.poll{Counted.polls}", "w").close()
        return gone
if sys.argv[2] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with Counted(say=print, grace_s=2.0):
    open(f"{sys.argv[1]}/rank{sys.argv[2]}", "w").close()
    time.sleep(120)
"""


def _job_processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if marker in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def _wait_for(paths, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not all of {paths} appeared"
        time.sleep(0.05)


def test_kill_9_of_the_clis_process_group_ends_the_runner_launch_py_and_every_rank(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}  # no torch import in the stand-ins
    # `setsid deepseek-ds train ...`: the CLI leads its own process group; the runner has a session of its own.
    cli = subprocess.Popen([sys.executable, "-c", CLI, sys.executable, "-c", RECORDING_RUNNER, str(tmp_path),
                            RANKS_LAUNCH, RANK], env=env, start_new_session=True)
    try:
        _wait_for([tmp_path / "rank0", tmp_path / "rank1"])
        assert len(_job_processes(str(tmp_path))) == 5  # the CLI, the runner, launch.py, 2 ranks
        os.killpg(cli.pid, signal.SIGKILL)
        killed = time.monotonic()
        cli.wait()
        while _job_processes(str(tmp_path)) and time.monotonic() - killed < 15:
            time.sleep(0.1)
        left = [" ".join(p.cmdline())[:80] for p in _job_processes(str(tmp_path))]
        assert left == [], f"{len(left)} processes of the job still run 15 s after kill -9 of the CLI"
        # The runner was told by its parent-death signal: across hosts its handler is what stops the remote ranks.
        assert (tmp_path / "runner_got").read_text() == "SIGTERM"
    finally:
        for p in _job_processes(str(tmp_path)):
            p.kill()


def test_a_rank_ends_with_its_launch_py_and_ignores_a_pid_from_another_host(tmp_path):
    """Over pdsh a rank's one link to the job is its parent, launch.py; a supervisor pid that srun or mpirun carried
    over from the CLI's host names nothing here (a pid that is gone here, which would stop the ranks at once)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", SUPERVISOR_ENV: f"{gone.pid} another-host"}
    launch = subprocess.Popen([sys.executable, "-c", RANKS_LAUNCH, str(tmp_path), "-", RANK], env=env)
    try:
        _wait_for([tmp_path / "rank0.poll2", tmp_path / "rank1.poll2"])  # each rank's watch polled twice
        assert len(_job_processes(str(tmp_path))) == 3  # launch.py and its 2 ranks
        launch.kill()
        launch.wait()
        killed = time.monotonic()
        while _job_processes(str(tmp_path)) and time.monotonic() - killed < 15:
            time.sleep(0.1)
        assert _job_processes(str(tmp_path)) == []
    finally:
        for p in _job_processes(str(tmp_path)):
            p.kill()
