"""kill -9 of `deepseek-ds train` takes the whole job down through the real launcher (launcher/lifeline.py): the
runner by its parent-death signal, every rank by its watch on the CLI, launch.py once its ranks have ended.
tests/test_supervise.py kills a stand-in CLI's process group and checks the remote ranks' watch on their launch.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepseek_ds.bench.failure_bench import FaultJob
from deepseek_ds.launcher.lifeline import STOP_GRACE_S

LEFT_AFTER_S = 15.0  # issue 46: no process of the job within 15 s


@pytest.mark.launch
def test_kill_9_of_deepseek_ds_train_leaves_no_process_of_the_job(tmp_path, data_dir):
    job = FaultJob(tmp_path, data_dir, cli=True)  # every process's argv carries its unique output directory
    try:
        job.wait_for_steps(1)  # training: every rank's stop handler and lifeline are armed
        cli = job.proc.pid
        others = [p for p in job.processes() if p.pid != cli]
        assert len(others) == 4, [p.cmdline()[:3] for p in others]  # the runner, launch.py, 2 ranks
        # None shares the CLI's process group (the runner has a session of its own): kill -9 of the process group of
        # `setsid deepseek-ds train` is kill -9 of the CLI, which is what is done here (its group is pytest's).
        assert all(os.getpgid(p.pid) != os.getpgid(cli) for p in others)
        job.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        job.proc.wait()
        while job.processes() and time.monotonic() - killed < LEFT_AFTER_S:
            time.sleep(0.1)
        took = time.monotonic() - killed
        left = [" ".join(p.cmdline())[:120] for p in job.processes()]
        assert left == [], f"{len(left)} processes of the job still run {LEFT_AFTER_S:.0f} s after kill -9 of the CLI"
        print(f"kill -9 of deepseek-ds train: no process of the job left after {took:.1f} s "
              f"(SIGKILL bound {STOP_GRACE_S:.0f} s after the ranks' SIGTERM)")
        for rank in (0, 1):  # what ended each rank, in its own log
            assert f"deepseek-ds: rank {rank} stops: `deepseek-ds train` (pid {cli}) is gone" in job.rank_log(rank)
    finally:
        for p in job.processes():
            p.kill()
