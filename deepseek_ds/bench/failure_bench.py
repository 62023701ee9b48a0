"""`deepseek-ds bench failures`: how a 2-rank job of recipes/tiny-v3.yaml ends when a rank is killed, hangs or fails
at start-up, and when it is stopped by a signal, through the real `deepspeed` launcher: the exit status, the seconds
until the launcher exits, the processes left, and the line that says what ended it. The measured rows of the
multi-node guide's failure table; tests/test_rank_failure.py runs the same cases and checks what ended each job."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from ..utils.cli_args import positive_int
from ..utils.fmt import text_table
from ..utils.net import free_port
from ..utils.system import bin_dir, launch_env
from .load import HostLoad, add_allow_busy, check_quiet_host

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny-v3.yaml"

# Only rank 1 is given a data.path that does not exist (as on a host that lacks the dataset).
ONE_BAD_HOST = """
import os, sys
from deepseek_ds.training.main import main
if os.environ["RANK"] == "1":
    sys.argv += ["--set", "data.path=/nonexistent/dataset"]
sys.exit(main())
"""


class FaultJob:
    """recipes/tiny-v3.yaml on 2 ranks under the real launcher, far from its last step; its output directory (unique
    per job) is in every process's argv, so what is left of the job can be found."""

    def __init__(self, work_dir: Path, data_dir: str, *sets: str, script: str = "train.py", cli: bool = False,
                 cli_args: tuple[str, ...] = ()):
        self.out = work_dir / "run"
        self.log = work_dir / "launcher.log"
        # cli: `deepseek-ds train` (which runs the deepspeed launcher under it, with cli_args), else `deepspeed script`
        launcher = ([os.path.join(bin_dir(), "deepseek-ds"), "train", *cli_args] if cli
                    else [os.path.join(bin_dir(), "deepspeed")])
        cmd = [*launcher, "--num_gpus", "2", "--master_port", str(free_port()), *([] if cli else [script]),
               "--config", RECIPE, "--set", f"train.output_dir={self.out}"]
        for s in (f"data.path={data_dir}", "train.steps=100000", "checkpoint.interval=0", "eval.interval=0", *sets):
            cmd += ["--set", s]
        env = launch_env()
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
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
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended before step {n}:\n{self.text()[-3000:]}")
            if time.monotonic() - self.started > 300:
                raise RuntimeError(f"no step {n} in 300 s:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> tuple[int, float]:
        """The launcher's exit status and when it ended (s since `timeout` was given); kills the job on timeout."""
        start = time.monotonic()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"the job still ran {timeout} s later\n{self.text()[-3000:]}") from None
        return rc, time.monotonic() - start

    def kill(self) -> None:
        for p in self.processes():
            p.kill()
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text()

    def rank_log(self, rank: int) -> str:
        return (self.out / "logs" / f"rank{rank}.log").read_text()


def _first_line(text: str, pattern: str) -> str:
    found = re.search(pattern, text)
    return found.group(0).strip() if found else "-"


@dataclasses.dataclass
class Outcome:
    what: str
    job: FaultJob
    status: int
    seconds: float  # from the fault (or signal) until the launcher exited
    ended_by: str  # the first line that says what ended the job
    left: int = dataclasses.field(init=False)  # the job's processes alive after it ended
    extra: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.left = len(self.job.processes())


COLUMNS = ["what happens", "status", "ended after (s)", "processes left", "what ended it (the first such line)"]


def _table(outcomes: list[Outcome]) -> str:
    rows = [[o.what, str(o.status), f"{o.seconds:.1f}", str(o.left), o.ended_by] for o in outcomes]
    return text_table(rows, COLUMNS, align=["left", "right", "right", "right", "left"])


def killed_rank(work: Path, data_dir: str) -> Outcome:
    job = FaultJob(work, data_dir)
    try:
        job.wait_for_steps()
        job.ranks()[1].send_signal(signal.SIGKILL)
        # Ended by the launcher, which sees the dead rank: rank 0 alone would wait out train.dist_timeout_s.
        rc, took = job.wait(timeout=300)
        return Outcome("rank 1 killed (kill -9)", job, rc, took,
                       _first_line(job.text(), r"exits with return code = -9"))
    finally:
        job.kill()


def hung_rank(work: Path, data_dir: str, timeout_s: int, kill_stopped: bool = False) -> Outcome:
    """Rank 1 SIGSTOPped: rank 0's next collective times out after train.dist_timeout_s, then DeepSpeed's launch.py
    SIGTERMs the stopped rank and SIGKILLs it 30 s later. kill_stopped: SIGKILL it here as soon as rank 0 has
    exited instead (those 30 s are DeepSpeed's, not what is measured)."""
    job = FaultJob(work, data_dir, f"train.dist_timeout_s={timeout_s}")
    try:
        job.wait_for_steps()
        rank0, rank1 = job.ranks()
        rank1.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        if kill_stopped:
            rank0.wait(timeout=10 * (timeout_s + 40))
            rank1.send_signal(signal.SIGKILL)
        rc, _ = job.wait(timeout=10 * (timeout_s + 40))
        took = time.monotonic() - start
        return Outcome(f"rank 1 hangs (SIGSTOP), train.dist_timeout_s={timeout_s}", job, rc, took,
                       _first_line(job.rank_log(0), r"Timed out waiting \d+ms"))
    finally:
        job.kill()


def bad_start(work: Path, data_dir: str) -> Outcome:
    script = work / "one_bad_host.py"
    script.write_text(ONE_BAD_HOST)
    job = FaultJob(work, data_dir, script=str(script))
    try:
        # Rank 0 would otherwise wait at the rendezvous for train.dist_timeout_s (1800 s).
        rc, _ = job.wait(timeout=300)
        return Outcome("rank 1 fails at start-up (its data.path missing), from the launch", job, rc,
                       time.monotonic() - job.started, _first_line(job.text(), r"deepseek-ds: [^\n]*"))
    finally:
        job.kill()


def sigterm(work: Path, data_dir: str) -> Outcome:
    """A scheduler's SIGTERM to `deepseek-ds train`: the ranks finish the step, save it and end."""
    job = FaultJob(work, data_dir, cli=True)
    try:
        job.wait_for_steps()
        job.proc.send_signal(signal.SIGTERM)
        rc, took = job.wait(timeout=300)
        return Outcome("SIGTERM of deepseek-ds train (the step saved)", job, rc, took,
                       _first_line(job.text(), r"stopped on SIGTERM: step \d+ saved"))
    finally:
        job.kill()


def second_sigterm(work: Path, data_dir: str) -> Outcome:
    """Rank 1 SIGSTOPped, so the first SIGTERM cannot reach a step boundary; a second one 3 s later ends rank 0 at
    once. Timed from the second signal until rank 0 exits; the stopped rank is then SIGKILLed here (launch.py would
    kill it 30 s after its SIGTERM: DeepSpeed's wait, not ours). extra: `gap` (s between the signals) and
    `waited_for_the_boundary` (rank 0 alive just before the second)."""
    job = FaultJob(work, data_dir)
    try:
        job.wait_for_steps()
        rank0, rank1 = job.ranks()
        rank1.send_signal(signal.SIGSTOP)
        job.launcher().send_signal(signal.SIGTERM)
        first = time.monotonic()
        time.sleep(3)
        waited = rank0.is_running()
        job.launcher().send_signal(signal.SIGTERM)
        second = time.monotonic()
        rank0.wait(timeout=120)
        took = time.monotonic() - second
        rank1.send_signal(signal.SIGKILL)
        rc, _ = job.wait(timeout=300)
        return Outcome("a second SIGTERM 3 s after the first, rank 1 stopped: until rank 0 exits", job, rc, took,
                       _first_line(job.rank_log(0), r"deepseek-ds: rank 0 exits at once[^\n]*"),
                       extra={"gap": second - first, "waited_for_the_boundary": waited})
    finally:
        job.kill()


@dataclasses.dataclass
class Recovery:
    """A rank killed under `deepseek-ds train --max-restarts` (launcher/restarts.py): how long until the job trains
    again and what it lost."""
    what: str
    restarts: int
    backoff_s: float
    to_first_step_s: float  # from the kill until the first step after the restart is logged
    steps_lost: int         # from the restart's record: logged steps after the checkpoint it resumed from
    cause: str


RECOVERY_COLUMNS = ["what happens", "restarts", "back-off (s)", "kill -> first step after the restart (s)",
                    "steps lost", "cause logged"]


def _recovery_table(rows: list[Recovery]) -> str:
    return text_table([[r.what, str(r.restarts), f"{r.backoff_s:g}", f"{r.to_first_step_s:.1f}", str(r.steps_lost),
                        r.cause] for r in rows], RECOVERY_COLUMNS,
                      align=["left", "right", "right", "right", "right", "left"])


def recovered_rank(work: Path, data_dir: str, interval: int = 4, backoff_s: float = 1.0) -> Recovery:
    """Rank 1 SIGKILLed once step interval + 1 is logged, under --max-restarts 1 with checkpoint.interval `interval`:
    the CLI restarts the job, which resumes from step `interval`."""
    from ..training.metrics import read_metrics

    job = FaultJob(work, data_dir, f"checkpoint.interval={interval}", cli=True,
                   cli_args=("--max-restarts", "1", "--restart-backoff", f"{backoff_s:g}"))
    try:
        job.wait_for_steps(interval + 1)
        job.ranks()[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while True:
            if job.proc.poll() is not None:
                raise RuntimeError(f"the job ended instead of restarting:\n{job.text()[-3000:]}")
            if time.monotonic() - killed > 300:
                raise RuntimeError(f"no step after a restart in 300 s:\n{job.text()[-3000:]}")
            records = read_metrics(str(job.out / "metrics.jsonl"), events=True)
            events = [i for i, r in enumerate(records) if r.get("event") == "restart"]
            if events and any("event" not in r for r in records[events[0] + 1:]):
                event = records[events[0]]
                return Recovery("rank 1 killed (kill -9) under --max-restarts 1", event["restart"], backoff_s,
                                time.monotonic() - killed, event["steps_lost"], event["cause"])
            time.sleep(0.05)
    finally:
        job.kill()


def run_failure_bench(data_dir: str, work_dir: str, timeout_s: int) -> list[Outcome]:
    cases = [("killed", killed_rank), ("bad-start", bad_start), ("sigterm", sigterm), ("second", second_sigterm),
             ("hung", lambda work, data: hung_rank(work, data, timeout_s))]
    outcomes = []
    for name, case in cases:
        work = Path(work_dir) / name
        work.mkdir(parents=True)
        outcomes.append(case(work, data_dir))
        print(_table(outcomes[-1:]), flush=True)
    return outcomes


def _bench(args: argparse.Namespace) -> int:
    from ..data import ensure_builtin_dataset

    if args.out:
        check_quiet_host(args.allow_busy)
    data_dir = args.data or ensure_builtin_dataset(str(ROOT / "data_cache"), 2048, 8.0, progress=False)
    with tempfile.TemporaryDirectory() as tmp, HostLoad() as load:
        outcomes = run_failure_bench(data_dir, args.work_dir or tmp, args.dist_timeout_s)
        work = Path(args.work_dir or tmp) / "recovered"
        work.mkdir(parents=True)
        recovery = _recovery_table([recovered_rank(work, data_dir)])
    text = _table(outcomes)
    print(text)
    print(recovery)
    if args.out:
        from .report import write_process_report  # torch, imported only after the measurement

        write_process_report(os.path.join(args.out, "failures.md"), "How a job ends when a rank fails", (
            f"{RECIPE} on 2 ranks of this host through the real `deepspeed` launcher, each case a job of its own "
            "started from nothing and hit after its second step; seconds from the fault (or the signal) until the "
            "launcher exits, one run each. `processes left`: the job's processes still alive after it."),
            ["```\n" + text + "\n```",
             "Unattended recovery (`deepseek-ds train --max-restarts 1`, checkpoint.interval 4, rank 1 killed once step "
             "5 is logged): the seconds from the kill until the restarted job logs its first step (the launcher's "
             "exit, the back-off, a new launch, the resume), and the steps trained again.",
             "```\n" + recovery + "\n```"], ranks=2, load=load)
    return 0


def register(subparsers) -> None:
    """Add `failures` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("failures", help="how fast a 2-rank job ends when a rank dies, hangs or fails to start")
    p.add_argument("--dist-timeout-s", type=positive_int, default=60,
                   help="train.dist_timeout_s of the hung-rank case (default 60)")
    p.add_argument("--data", help="prepared dataset (default: the built-in corpus)")
    p.add_argument("--work-dir", help="keep the jobs' outputs here (default: a temporary directory)")
    p.add_argument("--out", default=None, help="write the report OUT/failures.md (default: print only)")
    add_allow_busy(p)
    p.set_defaults(func=_bench)
