"""`deepseek-ds train --max-restarts` through the real launcher (launcher/restarts.py): rank 1 SIGKILLed at step >= 5
and again after the restart, the job restarts twice by itself, each time on a fresh rendezvous port and from its
newest checkpoint, and ends with exit 0 and the losses of the straight run (conftest.py `straight`, the same
settings in one launch: dropout included, so the ranks' RNG states are restored too) bit for bit. The loop's other
exits (a repeated failure without progress, the limit, a non-finite stop, a signal in the back-off) and `--max-restarts
0` (the default: one launch, its status) run in-process in tests/test_supervise.py, over stand-in launches."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from deepseek_ds.training.metrics import read_metrics
from helpers import BIN, ROOT, STRAIGHT_STEPS, launch_env, losses, resuming_sets

INTERVAL = 2  # checkpoints every 2 steps: a kill loses at most a step or two


def _job(out: Path) -> list[psutil.Process]:
    """Every process of the job (its output directory is in each argv), the CLI included."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if str(out) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def _rank(out: Path, rank: int) -> psutil.Process | None:
    for p in _job(out):
        with contextlib.suppress(psutil.Error, KeyError):
            if "deepseek_ds.training.main" in " ".join(p.cmdline()) and p.environ()["RANK"] == str(rank):
                return p
    return None


def _kill_rank_1(job: subprocess.Popen, out: Path, log: Path, after: list[int], at_step: int) -> int:
    """SIGKILL rank 1 of the attempt after restart len(after) as soon as it has logged step `at_step`; returns that
    rank's pid. Its pid is found first (the ranks start in seconds, while a step takes a fraction of one)."""
    metrics, deadline, rank1 = out / "metrics.jsonl", time.monotonic() + 300, None
    while True:
        assert job.poll() is None, f"the job ended ({job.returncode}) before the kill:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no step {at_step} in 300 s:\n{log.read_text()[-4000:]}"
        if rank1 is None or rank1.pid in after:
            rank1 = _rank(out, 1)
        with contextlib.suppress(OSError):  # records after the last restart's are this attempt's
            records = read_metrics(str(metrics), events=True)
            restarts = [i for i, r in enumerate(records) if r.get("event") == "restart"]
            if len(restarts) == len(after) and any(r["step"] >= at_step for r in records[(restarts or [-1])[-1] + 1:]):
                assert rank1 is not None and rank1.pid not in after
                rank1.send_signal(signal.SIGKILL)
                return rank1.pid
        time.sleep(0.01)


@pytest.mark.launch
def test_max_restarts_recovers_two_killed_ranks_with_the_straight_runs_losses(tmp_path, data_dir, straight):
    out, log = tmp_path / "run", tmp_path / "train.log"
    cmd = [os.path.join(BIN, "deepseek-ds"), "train", "--num_gpus", "2", "--config", "recipes/tiny-v3.yaml",
           "--max-restarts", "2", "--restart-backoff", "0.5", "--set", f"train.output_dir={out}"]
    for s in resuming_sets(data_dir, STRAIGHT_STEPS, INTERVAL):
        cmd += ["--set", s]
    with open(log, "w") as sink:
        job = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=sink, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        started = time.monotonic()
        killed = [_kill_rank_1(job, out, log, [], at_step=5)]
        times = [time.monotonic()]
        # The second kill only once a checkpoint newer than the first resume is published (step + 3 logged: step + 2
        # saved), so that it is progress, not a repeat, and is restarted.
        first = _wait_for_restart(job, out, log)["step"]
        times.append(time.monotonic())
        killed.append(_kill_rank_1(job, out, log, killed, at_step=first + INTERVAL + 1))
        times.append(time.monotonic())
        assert job.wait(timeout=300) == 0, log.read_text()[-6000:]
        times.append(time.monotonic())
        print("--max-restarts 2: first kill {:.1f} s after the start, restart record {:.1f} s after it, second kill "
              "{:.1f} s after that, the end {:.1f} s later".format(times[0] - started, *(b - a for a, b in zip(times,
                                                                                                    times[1:]))))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        for p in _job(out):
            p.kill()
    text = log.read_text()
    events = [r for r in read_metrics(str(out / "metrics.jsonl"), events=True) if "event" in r]
    assert [(e["restart"], e["max_restarts"]) for e in events] == [(1, 2), (2, 2)]
    for e in events:  # rank 1's SIGKILL, or rank 0's failure on the lost peer if launch.py saw that one first
        assert e["cause"] in ("a rank was killed by SIGKILL (exit status 247)", "a rank failed (exit status 1)")
        assert e["steps_lost"] == e["failed_after_step"] - e["step"] >= 0
        assert e["step"] % INTERVAL == 0 and e["step"] >= 4
        assert (f"deepseek-ds: restart {e['restart']} of 2 in 0.5 s: {e['cause']} at step {e['failed_after_step']}; "
                f"resuming from step {e['step']} ") in text
        assert f"resumed from step{e['step']:08d} at step {e['step']}" in text
    assert events[1]["step"] > events[0]["step"]
    ports = re.findall(r"deepspeed --num_gpus 2 --master_port (\d+) ", text)
    assert len(ports) == 3 and len(set(ports)) == 3, ports  # a fresh rendezvous port for each attempt
    assert "not restarted" not in text
    assert losses(read_metrics(str(out / "metrics.jsonl"))) == losses(straight)  # every step, bitwise


def _wait_for_restart(job: subprocess.Popen, out: Path, log: Path) -> dict:
    """The first restart's record, once the CLI has written it."""
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(OSError):
            events = [r for r in read_metrics(str(out / "metrics.jsonl"), events=True) if "event" in r]
            if events:
                return events[0]
        assert job.poll() is None, f"the job ended ({job.returncode}) without a restart:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no restart in 120 s:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)
