"""`deepseek-ds train`'s hold on the launcher (launcher/supervise.py), with stand-ins for DeepSpeed's processes: a
runner without signal handlers (as DeepSpeed's is on one host) over a launch.py that handles TERM only."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

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
    def send():
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
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
