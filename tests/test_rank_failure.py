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
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from deepseek_ds import checkpoint
from deepseek_ds.training import main as training_main
from deepseek_ds.training import signals
from deepseek_ds.training.setup import apply_timeout_to_all_groups
from deepseek_ds.training.signals import StopOnSignal
from deepseek_ds.utils.net import free_port
from helpers import BIN, ROOT, launch_env, read_metrics


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
class Job:
    """recipes/tiny-v3.yaml on 2 ranks under the real launcher, far from its last step; its output directory (unique
    per test) is in every process's argv, so what is left of the job can be found."""

    def __init__(self, tmp_path: Path, data_dir: str, *sets: str, script: str = "train.py", cli: bool = False):
        self.out = tmp_path / "run"
        self.log = tmp_path / "launcher.log"
        # cli: `deepseek-ds train` (which runs the deepspeed launcher under it), else `deepspeed script`
        launcher = [os.path.join(BIN, "deepseek-ds"), "train"] if cli else [os.path.join(BIN, "deepspeed")]
        cmd = [*launcher, "--num_gpus", "2", "--master_port", str(free_port()), *([] if cli else [script]),
               "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={self.out}"]
        for s in (f"data.path={data_dir}", "train.steps=100000", "checkpoint.interval=0", "eval.interval=0", *sets):
            cmd += ["--set", s]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    def processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            if str(self.out) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        return found

    def launcher(self) -> psutil.Process:
        """The per-node launcher (deepspeed.launcher.launch), which the runner starts and the ranks' parent."""
        return next(p for p in self.processes() if "deepspeed.launcher.launch" in " ".join(p.cmdline()))

    def ranks(self) -> list[psutil.Process]:
        return sorted(self.launcher().children(), key=lambda p: int(p.environ()["RANK"]))

    def wait_for_steps(self, n: int = 2) -> None:
        metrics = self.out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() - self.started < 300, "no steps in 300 s"
            time.sleep(0.1)

    def wait(self, timeout: float) -> tuple[int, float]:
        """The launcher's exit status and when it ended (s since `timeout` was given); kills the job on timeout."""
        start = time.monotonic()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job still ran {timeout} s later\n{self.text()[-3000:]}") from None
        return rc, time.monotonic() - start

    def kill(self) -> None:
        for p in self.processes():
            p.kill()
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text()

    def rank_log(self, rank: int) -> str:
        return (self.out / "logs" / f"rank{rank}.log").read_text()


@pytest.fixture
def job_cleanup():
    jobs = []
    yield jobs.append
    for job in jobs:  # whatever a failed assert left running (a SIGSTOPped rank above all)
        job.kill()


@pytest.mark.launch
def test_a_killed_rank_ends_the_job_and_leaves_no_process(tmp_path, data_dir, job_cleanup):
    job = Job(tmp_path, data_dir)
    job_cleanup(job)
    job.wait_for_steps()
    job.ranks()[1].send_signal(signal.SIGKILL)
    # Ended by the launcher, which sees the dead rank: rank 0 alone would wait out train.dist_timeout_s (1800 s),
    # far past this wait (several times what it takes on a loaded machine).
    rc, took = job.wait(timeout=120)
    print(f"kill -9 of rank 1: job ended in {took:.1f} s")
    assert rc != 0
    assert job.processes() == []
    assert "Timed out waiting" not in job.rank_log(0)


@pytest.mark.launch
def test_a_hung_rank_ends_the_job_after_the_dist_timeout(tmp_path, data_dir, job_cleanup):
    """Rank 1 is SIGSTOPped: rank 0's next collective times out after train.dist_timeout_s, then the launcher
    SIGTERMs the stopped rank and SIGKILLs it 30 s later (DeepSpeed's launch.py). Every process group, DeepSpeed's
    included, has the configured timeout."""
    timeout_s = 20
    job = Job(tmp_path, data_dir, f"train.dist_timeout_s={timeout_s}")
    job_cleanup(job)
    job.wait_for_steps()
    job.ranks()[1].send_signal(signal.SIGSTOP)
    # The rest: the step in flight, the ranks' and launchers' exits (seconds each on this shared CPU), launch.py's
    # 30 s before its SIGKILL (59 s in all measured): the wait allows ten times that; the logs say what ended it.
    rc, took = job.wait(timeout=10 * (timeout_s + 40))
    print(f"SIGSTOP of rank 1, train.dist_timeout_s={timeout_s}: job ended in {took:.1f} s")
    assert rc != 0 and took >= timeout_s  # not before the configured timeout
    assert job.processes() == []
    assert f"Timed out waiting {timeout_s * 1000}ms" in job.rank_log(0)  # gloo's own timeout ended rank 0
    for rank in (0, 1):  # DeepSpeed's ZeRO group (a copy of the world group) among them
        count, timeouts = re.search(r"(\d+) process groups, each with a (\S+) s timeout", job.rank_log(rank)).groups()
        assert int(count) >= 2 and timeouts == str(timeout_s)


@pytest.mark.launch
def test_sigterm_of_the_job_saves_the_current_step_and_exits_0(tmp_path, data_dir, job_cleanup):
    """A scheduler's SIGTERM to `deepseek-ds train`: passed on to launch.py (DeepSpeed's single-host runner would die
    of it and orphan the ranks), which passes it to the ranks; they save the step and end, and the job exits 0 although
    launch.py exits 1 after any signal (DeepSpeed's choice): the ranks' stop record says the stop was clean."""
    job = Job(tmp_path, data_dir, cli=True)
    job_cleanup(job)
    job.wait_for_steps()
    job.proc.send_signal(signal.SIGTERM)
    rc, took = job.wait(timeout=120)
    print(f"SIGTERM of deepseek-ds train: job ended in {took:.1f} s")
    # Status 0: every rank saved and ended by itself, before launch.py's SIGKILL 30 s after its SIGTERM (the job
    # would fail then), and before the watcher's stop deadline (it would end the rank with one line, status 1).
    assert rc == 0, job.text()[-3000:]
    assert job.processes() == []
    assert "exits at once" not in job.text()
    ckpt = str(job.out / "checkpoints")
    last = max(r["step"] for r in read_metrics(str(job.out)))
    assert checkpoint.latest_tag(ckpt) == checkpoint.tag_for(last)
    assert checkpoint.read_meta(os.path.join(ckpt, checkpoint.tag_for(last)))["step"] == last
    assert f"stopped on SIGTERM: step {last} saved to {ckpt}/{checkpoint.tag_for(last)}" in job.text()
    for rank in (0, 1):
        log = job.rank_log(rank)
        assert f"saving step {last} and exiting" in log and "this rank failed" not in log


@pytest.mark.launch
def test_a_second_sigterm_ends_a_rank_stuck_in_a_collective(tmp_path, data_dir, job_cleanup):
    """Rank 1 is SIGSTOPped, so rank 0 cannot reach the step boundary after the launcher's SIGTERM; a second SIGTERM
    3 s later ends rank 0 at once with one line. The stopped rank is then SIGKILLed here: launch.py would kill it 30 s
    after its SIGTERM, DeepSpeed's wait, not ours."""
    job = Job(tmp_path, data_dir)
    job_cleanup(job)
    job.wait_for_steps()
    rank0, rank1 = job.ranks()
    rank1.send_signal(signal.SIGSTOP)
    launcher = job.launcher()
    launcher.send_signal(signal.SIGTERM)
    first = time.monotonic()
    time.sleep(3)
    assert rank0.is_running()  # one SIGTERM: waiting for the step boundary that the stopped rank 1 holds up
    launcher.send_signal(signal.SIGTERM)
    gap = time.monotonic() - first
    # What ended rank 0 is read from the line it left: the second SIGTERM, not the watcher's stop deadline (20 s after
    # the first) nor launch.py's SIGKILL (30 s after it, no line). The waits only bound a hang.
    rank0.wait(timeout=120)
    rank1.send_signal(signal.SIGKILL)
    rc, took = job.wait(timeout=300)
    print(f"second SIGTERM {gap:.1f} s after the first: the job ended {took:.1f} s later")
    assert rc != 0
    assert job.processes() == []
    line = r"deepseek-ds: rank 0 exits at once, without saving: SIGTERM (\d+) s after SIGTERM\n"
    for text in (job.text(), job.rank_log(0)):
        after = int(re.search(line, text).group(1))
        assert signals.REPEAT_GRACE_S < after and round(gap) - 1 <= after <= round(gap) + 1


# Only rank 1 is given a data.path that does not exist (as on a host that lacks the dataset).
ONE_BAD_HOST = """
import os, sys
from deepseek_ds.training.main import main
if os.environ["RANK"] == "1":
    sys.argv += ["--set", "data.path=/nonexistent/dataset"]
sys.exit(main())
"""


@pytest.mark.launch
def test_a_rank_that_fails_at_start_up_ends_the_job(tmp_path, data_dir, job_cleanup):
    script = tmp_path / "one_bad_host.py"
    script.write_text(ONE_BAD_HOST)
    job = Job(tmp_path, data_dir, script=str(script))
    job_cleanup(job)
    # Rank 0 would otherwise wait at the rendezvous for train.dist_timeout_s (1800 s), far past this wait.
    rc, took = job.wait(timeout=300)
    print(f"rank 1 refused at start-up: job ended {took:.1f} s after the launch")
    assert rc == 2
    assert job.processes() == []
    text = job.text()
    assert text.count("deepseek-ds: error: invalid configuration:\n  - data.path '/nonexistent/dataset' does not "
                      "exist") == 1, text[-3000:]
