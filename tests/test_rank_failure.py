"""A dead, hung or failing rank ends the whole job fast, and a stop request that cannot reach a step boundary ends
the rank at once: the ranks' signal watcher and the process groups' timeouts in-process, then each failure through
the real `deepspeed` launcher on 2 CPU ranks. Bounds are checked on what ended the job (status, the lines it left,
the seconds its messages name against what was configured), not on wall-clock time, which a loaded machine
stretches; waits bound only a hang."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deepseek_ds import checkpoint
from deepseek_ds.bench import failure_bench
from deepseek_ds.training import main as training_main
from deepseek_ds.training import signals
from deepseek_ds.training.process import apply_timeout_to_all_groups
from deepseek_ds.training.signals import StopOnSignal
from helpers import ROOT, read_metrics


# ----------------------------------------------------------------------------------------------- in-process
@pytest.mark.unit
def test_every_process_group_gets_the_configured_timeout(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1,
                            timeout=timedelta(seconds=42))
    try:
        made_like_deepspeed = dist.new_group([0])  # deepspeed.comm.new_group(ranks) passes no timeout

        def timeout_s(group):
            return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

        assert timeout_s(made_like_deepspeed) == 1800  # torch's gloo default, not the world group's 42 s
        reported = apply_timeout_to_all_groups(42)
        assert timeout_s(made_like_deepspeed) == 42 and timeout_s(dist.group.WORLD) == 42
        assert reported == [42.0, 42.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
def test_signals_set_a_flag_and_the_handlers_come_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with StopOnSignal(torch.device("cpu")) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # at once after the first: the same request, the process is still here
        assert stop.received == "SIGTERM"
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(-1) == -1  # no wakeup fd left installed


@pytest.mark.unit
def test_an_exit_0_in_the_middle_of_training_is_a_failure(tmp_path, monkeypatch, capsys):
    """Status 0 would tell the launcher that the rank is done, and leave the other ranks waiting on it."""
    def exits_early(_cfg, _ds):
        sys.exit(0)

    monkeypatch.setattr(training_main, "build_run", exits_early)
    assert training_main.main(["--config", os.path.join(ROOT, "recipes", "tiny-v3.yaml"),
                               "--set", f"train.output_dir={tmp_path}"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "deepseek-ds: rank 0 was made to exit with status 0 before the end of training (traceback in its log): "
        "exiting 1")


# A process that uses StopOnSignal as a rank does (one-rank gloo group), signalling itself.
WATCHER = """
import os, signal, sys, time, torch, torch.distributed as dist
from deepseek_ds.training.signals import StopOnSignal
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
with StopOnSignal(torch.device("cpu"), deadline_s=1.0) as stop:
    if sys.argv[2] == "stuck":  # two step boundaries 1.2 s apart: a slow step, so the bound becomes 2 x the step
        start = time.monotonic()
        assert not stop.requested()
        time.sleep(1.2)
        assert not stop.requested()
        print(f"step at most {time.monotonic() - start:.3f} s", flush=True)  # what the watcher timed, and a little
    first = time.monotonic()
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)  # what the runner sends after a Ctrl-C's SIGINT: not a second request
    if sys.argv[2] == "busy":  # a save or an evaluation past the deadline: not a hung step
        with stop.busy():
            time.sleep(2.5)
        print("alive after the busy work", flush=True)
        time.sleep(0.3)  # the deadline counts from the end of the work
    if sys.argv[2] in ("boundary", "busy"):
        assert stop.requested()  # the step boundary is reached: the deadline no longer applies
    print("waiting", flush=True)
    # stuck: only the deadline can end it; after the boundary (saving), past the deadline, until a second request
    time.sleep(60 if sys.argv[2] == "stuck" else 3)
    print("alive after the deadline", flush=True)
    print(f"second signal {time.monotonic() - first:.3f} s after the first", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # a second request, at least 3 s after the first
    time.sleep(60)
"""


@pytest.mark.unit
@pytest.mark.parametrize("case", ["stuck", "boundary", "busy"])
def test_a_stuck_stop_or_a_second_signal_ends_the_rank_at_once(case, tmp_path):
    script = tmp_path / "watcher.py"
    script.write_text(WATCHER)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "rendezvous"), case], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "RANK": "3"})
    assert proc.returncode == signals.ABORT_STATUS, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("deepseek-ds: rank 3 exits at once, without saving: ")
    # Bounds are read from the message and checked against what was configured and slept, not against the clock:
    # the watcher prints them rounded to the second.
    if case == "stuck":
        step = float(re.fullmatch(r"step at most (\S+) s", out[0]).group(1))
        assert out[1:] == ["waiting"]  # ended by the deadline, long before the script's own second signal
        bound = int(re.fullmatch(r".*: no step boundary within (\d+) s of SIGINT \(a collective is hung: has another "
                                 r"rank stopped or died\?\)", line).group(1))
        # STEP_FACTOR x the slowest step (1.2 s slept, `step` timed around it), above deadline_s's 1 s
        assert round(signals.STEP_FACTOR * 1.2) <= bound <= math.ceil(signals.STEP_FACTOR * step) and bound > 1
    else:
        busy = ["alive after the busy work"] if case == "busy" else []
        assert out[:-1] == [*busy, "waiting", "alive after the deadline"]
        gap = float(re.fullmatch(r"second signal (\S+) s after the first", out[-1]).group(1))
        after = int(re.fullmatch(r".*: SIGTERM (\d+) s after SIGINT", line).group(1))
        # a second request (more than REPEAT_GRACE_S after the first), timed as the script sent it
        assert signals.REPEAT_GRACE_S < after and round(gap) - 1 <= after <= round(gap) + 1


# ----------------------------------------------------------------------------------------------- launched
@pytest.mark.launch
def test_a_killed_rank_ends_the_job_and_leaves_no_process(tmp_path, data_dir):
    # bench failures' own case: a bound on its wait only (rank 0 alone would wait out train.dist_timeout_s)
    out = failure_bench.killed_rank(tmp_path, data_dir)
    print(f"kill -9 of rank 1: job ended in {out.seconds:.1f} s")
    assert out.status != 0
    assert out.left == 0
    assert out.ended_by == "exits with return code = -9"
    assert "Timed out waiting" not in out.job.rank_log(0)


@pytest.mark.launch
def test_a_hung_rank_ends_the_job_after_the_dist_timeout(tmp_path, data_dir):
    """Rank 1 is SIGSTOPped: rank 0's next collective times out after train.dist_timeout_s, and the job ends (the
    stopped rank SIGKILLed once rank 0 is gone: launch.py would wait 30 s after its SIGTERM, DeepSpeed's wait; bench
    failures times it). Every process group, DeepSpeed's included, has the configured timeout."""
    timeout_s = 20
    # The wait allows ten times the timeout and more; the logs say what ended it.
    out = failure_bench.hung_rank(tmp_path, data_dir, timeout_s, kill_stopped=True)
    print(f"SIGSTOP of rank 1, train.dist_timeout_s={timeout_s}: job ended in {out.seconds:.1f} s")
    assert out.status != 0 and out.seconds >= timeout_s  # not before the configured timeout
    assert out.left == 0
    assert out.ended_by == f"Timed out waiting {timeout_s * 1000}ms"  # gloo's own timeout ended rank 0
    for rank in (0, 1):  # DeepSpeed's ZeRO group (a copy of the world group) among them
        count, timeouts = re.search(r"(\d+) process groups, each with a (\S+) s timeout",
                                    out.job.rank_log(rank)).groups()
        assert int(count) >= 2 and timeouts == str(timeout_s)


@pytest.mark.launch
def test_sigterm_of_the_job_saves_the_current_step_and_exits_0(tmp_path, data_dir):
    """A scheduler's SIGTERM to `deepseek-ds train`: passed on to launch.py (DeepSpeed's single-host runner would die
    of it and orphan the ranks), which passes it to the ranks; they save the step and end, and the job exits 0 although
    launch.py exits 1 after any signal (DeepSpeed's choice): the ranks' stop record says the stop was clean."""
    out = failure_bench.sigterm(tmp_path, data_dir)
    job = out.job
    print(f"SIGTERM of deepseek-ds train: job ended in {out.seconds:.1f} s")
    # Status 0: every rank saved and ended by itself, before launch.py's SIGKILL 30 s after its SIGTERM (the job
    # would fail then), and before the watcher's stop deadline (it would end the rank with one line, status 1).
    assert out.status == 0, job.text()[-3000:]
    assert out.left == 0
    assert "exits at once" not in job.text()
    ckpt = str(job.out / "checkpoints")
    last = max(r["step"] for r in read_metrics(str(job.out)))
    assert checkpoint.latest_tag(ckpt) == checkpoint.tag_for(last)
    assert checkpoint.read_meta(os.path.join(ckpt, checkpoint.tag_for(last)))["step"] == last
    assert out.ended_by == f"stopped on SIGTERM: step {last} saved"
    assert f"stopped on SIGTERM: step {last} saved to {ckpt}/{checkpoint.tag_for(last)}" in job.text()
    for rank in (0, 1):
        log = job.rank_log(rank)
        assert f"saving step {last} and exiting" in log and "this rank failed" not in log


@pytest.mark.launch
def test_a_second_sigterm_ends_a_rank_stuck_in_a_collective(tmp_path, data_dir):
    """Rank 1 is SIGSTOPped, so rank 0 cannot reach the step boundary after the launcher's SIGTERM; a second SIGTERM
    3 s later ends rank 0 at once with one line (bench failures' case, which then SIGKILLs the stopped rank)."""
    out = failure_bench.second_sigterm(tmp_path, data_dir)
    gap = out.extra["gap"]
    print(f"second SIGTERM {gap:.1f} s after the first: rank 0 ended {out.seconds:.1f} s later")
    assert out.extra["waited_for_the_boundary"]  # one SIGTERM: waiting for the boundary the stopped rank 1 holds up
    assert out.status != 0
    assert out.left == 0
    # What ended rank 0 is read from the line it left: the second SIGTERM, not the watcher's stop deadline (20 s after
    # the first) nor launch.py's SIGKILL (30 s after it, no line). The waits only bound a hang.
    line = r"deepseek-ds: rank 0 exits at once, without saving: SIGTERM (\d+) s after SIGTERM\n"
    for text in (out.job.text(), out.job.rank_log(0)):
        after = int(re.search(line, text).group(1))
        assert signals.REPEAT_GRACE_S < after and round(gap) - 1 <= after <= round(gap) + 1


@pytest.mark.launch
def test_a_rank_that_fails_at_start_up_ends_the_job(tmp_path, data_dir):
    out = failure_bench.bad_start(tmp_path, data_dir)
    print(f"rank 1 refused at start-up: job ended {out.seconds:.1f} s after the launch")
    assert out.status == 2
    assert out.left == 0
    text = out.job.text()
    assert text.count("deepseek-ds: error: invalid configuration:\n  - data.path '/nonexistent/dataset' does not "
                      "exist") == 1, text[-3000:]
