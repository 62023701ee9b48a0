"""`deepseek-ds train`'s hold on the launcher (launcher/supervise.py), with stand-ins for DeepSpeed's processes: a
runner without signal handlers (as DeepSpeed's is on one host) over a launch.py that handles TERM only; and the job's
end with the CLI's (launcher/lifeline.py: kill -9 of the CLI; a remote rank whose launch.py dies). The same through
the real launcher: tests/test_job_lifeline.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from deepseek_ds import cli as cli_module
from deepseek_ds.cli import build_parser, train_command
from deepseek_ds.inference import cli as inference_cli
from deepseek_ds.launcher import supervise
from deepseek_ds.launcher.lifeline import SUPERVISOR_ENV
from deepseek_ds.launcher.restarts import Attempt, NoRestart, Progress, append_record, run_with_restarts
from deepseek_ds.launcher.supervise import run_launcher
from deepseek_ds.training.metrics import MetricsWriter, read_metrics
from helpers import ROOT, cli

pytestmark = pytest.mark.unit
RECIPE = os.path.join(ROOT, "recipes", "tiny-v3.yaml")

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


# ----------------------------------------------------------------------------------------------- rendezvous ports
def _bound_port() -> socket.socket:
    """A socket listening on a port (as another job's TCPStore would): the port is in use until it is closed."""
    sock = socket.socket()
    sock.bind(("", 0))
    sock.listen()
    return sock


def _no_launch(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")
    monkeypatch.setattr(supervise.subprocess, "Popen", refuse)
    monkeypatch.setattr(inference_cli.os, "execv", refuse)


def test_train_without_a_port_takes_a_free_one_and_refuses_one_in_use(monkeypatch, capsys):
    command = train_command(build_parser().parse_args(["train", "--config", RECIPE, "--num_gpus", "2"]))
    port = int(command[command.index("--master_port") + 1])
    with socket.socket() as s:  # free: it binds as the ranks' store will (SO_REUSEADDR, every address)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
    _no_launch(monkeypatch)
    with _bound_port() as taken:
        busy = taken.getsockname()[1]
        assert cli(["train", "--config", RECIPE, "--num_gpus", "2", "--master_port", str(busy)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before validation and before any process
    assert err.splitlines() == [f"deepseek-ds: error: --master_port {busy} cannot be used on this host: in use "
                                "(another job's rendezvous?) (leave --master_port out to take a free port, or give "
                                "another)"]


def test_a_launched_eval_takes_a_free_port_and_refuses_one_in_use(monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(inference_cli.os, "execv", lambda path, argv: launched.append(argv))
    assert cli(["eval", "--checkpoint", "runs/x", "--num_gpus", "2"]) == 0
    port = int(launched[0][launched[0].index("--master_port") + 1])
    assert supervise.port_free(port)["free"]
    _no_launch(monkeypatch)
    with _bound_port() as taken:
        busy = taken.getsockname()[1]
        assert cli(["eval", "--checkpoint", "runs/x", "--num_gpus", "2", "--master_port", str(busy)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"deepseek-ds: error: --master_port {busy} cannot be used on this host: in use (another job's rendezvous?) "
        "(leave --master_port out to take a free port, or give another)"]


# ----------------------------------------------------------------------------------------------- restarts
# The production restart loop over stand-in launches: a command that exits with a given status.
def _exits(status: int) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.exit({status})"]


def _restarts(tmp_path, statuses: list[int], checkpoints: list[int], max_restarts: int = 5, backoff_s: float = 0):
    """run_with_restarts over launches that exit with `statuses` in turn, the newest checkpoint after each being
    `checkpoints` (each failure logged 3 steps past it); returns (its result, the lines it printed)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    attempts, lines = iter(statuses[1:]), []
    ended = []

    def progress() -> Progress:
        ended.append(None)
        step = checkpoints[len(ended) - 1]
        return Progress(step, step + 3)

    result = run_with_restarts(_exits(statuses[0]), lambda: Attempt(_exits(next(attempts))), False, max_restarts,
                               backoff_s, progress, str(metrics), say=lines.append)
    return result[:2], [line for line in lines if not line.startswith(sys.executable)]


def test_a_failure_again_without_a_newer_checkpoint_stops_the_restarts_in_one_line(tmp_path):
    result, lines = _restarts(tmp_path, [1, 247, 247, 0], [4, 8, 8])
    assert result == (247, None)
    assert lines == [
        "deepseek-ds: restart 1 of 5 in 0 s: a rank failed (exit status 1) at step 7; resuming from step 4 "
        "(3 steps lost)",
        "deepseek-ds: restart 2 of 5 in 0 s: a rank was killed by SIGKILL (exit status 247) at step 11; resuming from "
        "step 8 (3 steps lost)",
        "deepseek-ds: not restarted: a rank was killed by SIGKILL (exit status 247) at step 11 again, with no "
        "checkpoint newer than step 8 since the previous failure: a restart would repeat it"]
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert [(e["event"], e["step"], e["restart"], e["exit_status"], e["steps_lost"]) for e in events] == [
        ("restart", 4, 1, 1, 3), ("restart", 8, 2, 247, 3)]


def test_restarts_end_at_the_limit_or_on_the_ranks_verdict(tmp_path):
    assert _restarts(tmp_path, [1, 1, 0], [2, 4], max_restarts=1) == ((1, None), [
        "deepseek-ds: restart 1 of 1 in 0 s: a rank failed (exit status 1) at step 5; resuming from step 2 "
        "(3 steps lost)",
        "deepseek-ds: not restarted: a rank failed (exit status 1) at step 7, and --max-restarts 1 are used up"])
    assert _restarts(tmp_path, [3, 0], [2]) == ((3, None), [
        "deepseek-ds: not restarted: exit status 3: training stopped on non-finite losses (the ranks' line says why)"])
    assert _restarts(tmp_path, [1, 0], [2], max_restarts=0) == ((1, None), [])  # as without --max-restarts
    assert _restarts(tmp_path, [1, 0], [2]) == ((0, None), [
        "deepseek-ds: restart 1 of 5 in 0 s: a rank failed (exit status 1) at step 5; resuming from step 2 "
        "(3 steps lost)"])


def test_a_restart_its_command_refuses_ends_the_restarts_in_one_line_unrecorded(tmp_path):
    """--elastic's check before a restart (cli._restart) raises NoRestart for a lost host it may not leave out."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    lines = []

    def refuse() -> Attempt:
        raise NoRestart("host dsnode3 (ssh: timed out) is lost; restart with --elastic to go on without it")
    result = run_with_restarts(_exits(1), refuse, False, 2, 0, lambda: Progress(2, 5), str(metrics), say=lines.append)
    assert result[:2] == (1, None)
    assert lines[-1] == ("deepseek-ds: not restarted: host dsnode3 (ssh: timed out) is lost; restart with --elastic "
                         "to go on without it")
    assert "event" not in metrics.read_text()


def test_a_signal_during_the_back_off_ends_the_restarts(tmp_path):
    def send():  # once the back-off's handler is set, never at a deadline (before it, SIGTERM would end pytest)
        while "_back_off" not in getattr(signal.getsignal(signal.SIGTERM), "__qualname__", ""):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=send, daemon=True).start()
    result, lines = _restarts(tmp_path, [1, 0], [2], backoff_s=30)
    assert result == (1, None)
    assert lines[-1] == "deepseek-ds: not restarted: SIGTERM during the back-off"
    assert "event" not in (tmp_path / "metrics.jsonl").read_text()  # no restart recorded: none happened


def test_a_restart_record_survives_a_torn_line_and_the_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')  # cut by the kill
    append_record(str(path), {"event": "restart", "step": 2})
    assert read_metrics(str(path), events=True) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5},
                                                    {"event": "restart", "step": 2}]
    writer = MetricsWriter(str(path), resume_step=2)  # what the restarted rank 0 does
    writer.write({"step": 3, "loss": 1.25})
    writer.close()
    assert [r["step"] for r in writer.records] == [1, 2, 3]  # the summary and plot see steps only
    assert read_metrics(str(path)) == writer.records
    assert read_metrics(str(path), events=True)[2] == {"event": "restart", "step": 2}


def test_train_ends_with_the_launchers_status_and_restarts_only_when_asked(tmp_path, monkeypatch, capsys):
    """cmd_train's wiring (the production loop, _progress on a run without checkpoints), the launch a stand-in that
    ends as a job with a SIGKILLed rank does: without --max-restarts exactly as before, one run and its status."""
    monkeypatch.setattr(cli_module, "train_command", lambda args: _exits(247))
    train = ["train", "--config", RECIPE, "--num_gpus", "2", "--set", f"train.output_dir={tmp_path}"]
    assert cli(train) == 247
    assert "restart" not in capsys.readouterr().out
    assert cli([*train, "--max-restarts", "3", "--restart-backoff", "0"]) == 247
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("deepseek-ds:")]
    assert lines == [
        "deepseek-ds: restart 1 of 3 in 0 s: a rank was killed by SIGKILL (exit status 247) before the first step; "
        "starting over (no checkpoint) (0 steps lost)",
        "deepseek-ds: not restarted: a rank was killed by SIGKILL (exit status 247) before the first step again, with "
        "no checkpoint newer than step 0 since the previous failure: a restart would repeat it"]
