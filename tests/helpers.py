"""What the tests share: launching ranks (run_ranks; the real `deepspeed` launcher where the launcher is under test)
of train.py or another script and reading what they wrote, the `deepseek-ds` command line in-process,
checkpoint-directory copies, and the loss of a training step's global batch recomputed in one process. Tests import this module, never each other."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import io
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

from deepseek_ds.config import ConfigError, validate
from deepseek_ds.utils import system
from deepseek_ds.utils.net import free_port
from reference_data import StreamSamples, step_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = system.bin_dir()
IGNORE_INDEX = -100  # the label transformers' and our losses skip


# ----------------------------------------------------------------------------------------------- launching
def launch_env() -> dict:
    """The product's launch environment, with the JIT ops' cache set up by scripts/setup.sh (a test run started
    without sourcing it still finds the built ops)."""
    env = system.launch_env()
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
    return env


def deepspeed(nproc: int, script_args: list[str], timeout: int = 600,
              check: bool = True) -> subprocess.CompletedProcess:
    """The real `deepspeed` launcher on this host. It runs in a session of its own, so that a timeout (its own or
    the test's) ends its launch.py and ranks too, not only the runner."""
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port())] + script_args
    with subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        finally:
            if job.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.pid, signal.SIGKILL)
    proc = subprocess.CompletedProcess(cmd, job.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_ranks(nproc: int, script_args: list[str], timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus nproc SCRIPT_ARGS`, started faster: each rank is forked from a server process that has
    imported torch, DeepSpeed, transformers and this toolkit once for the session (RANK_PRELOAD), instead of an
    interpreter per rank importing them (~4.5 CPU-s each) behind the launcher's own two (its runner and launch.py,
    ~3 s, and launch.py's once-a-second poll). The ranks get what launch.py gives them (its environment,
    `--local_rank=N`, unbuffered output, `-m` for --module, sys.argv, sys.path and __main__ as `python SCRIPT` sets
    them, the default start method for their own subprocesses, non-daemon threads joined at exit) and the job ends
    as launch.py ends it: when a rank fails, the others' process trees get SIGTERM, then SIGKILL 30 s later, and the
    job's status is the failed rank's. A job past `timeout` (or the test's own limit) first has every rank print its
    threads' stacks. What differs: a module the server preloaded keeps what it read from the environment at import
    (the server starts with the session's environment, before any test changes it). Tests of the launcher itself
    use deepspeed()."""
    module = script_args[0] == "--module"
    target, rest = (script_args[1], script_args[2:]) if module else (script_args[0], script_args[1:])
    env = launch_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc), LOCAL_SIZE=str(nproc),
               CROSS_RANK="0", CROSS_SIZE="1", CUDA_VISIBLE_DEVICES=",".join(map(str, range(nproc))))
    what = " ".join([sys.executable, "-u"] + (["-m"] if module else []) + [target] + rest)
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        ended = False
        try:
            for rank in range(nproc):
                procs.append(_rank_server().Process(target=_run_rank, args=(
                    module, target, [f"--local_rank={rank}"] + rest,
                    {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, out, err)))
                procs[-1].start()
            status = _wait_like_launch_py(procs, time.monotonic() + timeout, what, timeout)
            ended = True
        finally:
            running = [p for p in procs if p.exitcode is None]
            if not ended and running:  # a timeout or the test's limit: what each rank was doing goes to the report
                for p in running:  # one at a time: their stacks would interleave in the shared file
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(1)
                if os.path.exists(err):
                    print(f"--- the ranks' stderr (stacks at the end) of {what}\n{Path(err).read_text()[-20000:]}",
                          file=sys.stderr)
            _end_process_trees(running, grace_s=30)
        proc = subprocess.CompletedProcess(what, status, *(Path(f).read_text() if os.path.exists(f) else ""
                                                           for f in (out, err)))
    if check and status != 0:
        raise AssertionError(f"{what} on {nproc} ranks exited {status}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


# What every rank imports before its first line runs (train.py and the test workers): imported once, in the server.
RANK_PRELOAD = ["torch", "deepspeed", "transformers", "deepspeed.runtime.zero.muon.muon_optimizer", "peft",
                "matplotlib.pyplot", "deepseek_ds.training.main", "deepseek_ds.inference.cli", "deepseek_ds.cli"]
# The environment the session started with: the server's, whichever test first needs it.
SESSION_ENV = dict(os.environ)
TESTS = os.path.join(ROOT, "tests")


@functools.cache
def _rank_server() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    test_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(SESSION_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(test_env)
    return ctx


def _run_rank(module: bool, target: str, args: list[str], env: dict, out: str, err: str) -> None:
    """One rank, in a process forked from the server: `python -u [-m] TARGET ARGS` with env, cwd ROOT."""
    multiprocessing.set_start_method(None, force=True)  # a rank's own subprocesses: the platform's default method
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    sys.stdout, sys.stderr = (io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), write_through=True)
                              for fd in (1, 2))  # python -u
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # run_ranks asks for stacks on a hang
    # sys.path as `python [-m] TARGET` makes it: the script's folder (the working directory for -m) first, then
    # PYTHONPATH, then the interpreter's own; not the test session's folders.
    own = [p for p in sys.path if p not in ("", ROOT, TESTS)]
    first = ROOT if module else os.path.dirname(os.path.abspath(target))
    sys.path[:] = [first] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + own
    sys.argv = [target] + args
    code = 0
    try:
        if module:
            sys.modules.pop(target, None)  # preloaded: `python -m` runs the module once, as __main__
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv[0] = os.path.abspath(target)
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        threading._shutdown()  # what the interpreter does at exit, in its order: join non-daemon threads,
        atexit._run_exitfuncs()  # then the exit functions (multiprocessing's children skip both)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _wait_like_launch_py(procs: list, deadline: float, what: str, timeout: float) -> int:
    while True:
        codes = [p.exitcode for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            _end_process_trees([p for p, c in zip(procs, codes) if c is None], grace_s=30)
            return failed[0] % 256  # launch.py's sys.exit(returncode): a signal's -N becomes 256 - N
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(what, timeout)
        time.sleep(0.05)


def _end_process_trees(procs: list, grace_s: float) -> None:
    """launch.py's terminate_process_tree for each: SIGTERM to the process and its children, SIGKILL after grace_s."""
    tree = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(p.pid)
            tree += root.children(recursive=True) + [root]
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    for p in procs:
        p.join()


def train(nproc: int, output_dir: str, sets: list[str], ds_config: str | None = None,
          config: str = "recipes/tiny-v3.yaml", timeout: int = 600) -> list[dict]:
    """Run train.py under the launcher; returns the records of metrics.jsonl."""
    args = ["train.py", "--config", config, "--set", f"train.output_dir={output_dir}"]
    if ds_config:
        args += ["--deepspeed_config", ds_config]
    for s in sets:
        args += ["--set", s]
    run_ranks(nproc, args, timeout=timeout)
    return read_metrics(output_dir)


def train_layouts(nproc: int, root: Path, layouts: list, sets: list[str], worker: str = "tests/layouts_worker.py",
                  config: str = "recipes/tiny-v3.yaml", timeout: int = 900,
                  worker_args: tuple[str, ...] = ()) -> dict[str, Path]:
    """Every layout (name, deepspeed config, extra --set values) trained in ONE launch of `worker` (layouts_worker.py
    or one built on it), one after the other: one start-up instead of one per layout. Returns each layout's
    train.output_dir (root / name)."""
    spec = [[ds_config, extra + [f"train.output_dir={root / name}"]] for name, ds_config, extra in layouts]
    args = [worker, "--config", config, "--layouts", json.dumps(spec), *worker_args]
    for s in sets:
        args += ["--set", s]
    run_ranks(nproc, args, timeout=timeout)
    return {name: root / name for name, _, _ in layouts}


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a job started with start_new_session (the launcher and every rank: its process group) and wait until
    none of it is left (init reaps the orphaned ranks a moment after the launcher)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    gone = time.monotonic() + 30
    while _group_alive(proc.pid):
        assert time.monotonic() < gone, "a rank outlived the kill of its process group"
        time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def read_metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


def router_biases(records: list[dict]) -> dict[int, dict]:
    """Per step, the router-bias statistics the training loop logs (after that step's bias update)."""
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("moe/") and "/bias_" in k} for r in records}


# ----------------------------------------------------------------------------------------------- checkpoints
def checkpoint_sets(data_dir: str, steps: int, interval: int, *extra: str) -> list[str]:
    """The --set overrides of the checkpointing runs (conftest.py's, and their resumes)."""
    return [f"data.path={data_dir}", f"train.steps={steps}", f"checkpoint.interval={interval}", "eval.interval=0",
            *extra]


# The runs resumed again and again (test_resume_chain.py's chain, test_checkpoint_kills.py's killed relaunches) and
# their one straight reference (conftest.py `straight`): attention dropout on (the tiny presets have none), so every
# resume must also have restored each rank's torch RNG to repeat the straight run bit for bit.
DROPOUT = "model.overrides.attention_dropout=0.1"
STRAIGHT_STEPS = 14


def resuming_sets(data_dir: str, steps: int, interval: int) -> list[str]:
    return checkpoint_sets(data_dir, steps, interval, "data.seq_len=32", "checkpoint.keep=2", DROPOUT)


def snapshot(ckpt_dir: Path, tag: str, dest: Path) -> Path:
    """A copy of one step directory, so later runs writing into `ckpt_dir` do not change it."""
    shutil.copytree(ckpt_dir / tag, dest / tag)
    return dest / tag


def fresh_ckpt_dir(step_dir: Path, dest: Path) -> Path:
    """A checkpoint.dir holding only `step_dir`: what a resuming run gets to write into."""
    shutil.copytree(step_dir, dest / step_dir.name)
    return dest


# ----------------------------------------------------------------------------------------------- in-process
def cli(argv: list[str]) -> int:
    """`deepseek-ds ARGV` in this process, through the real entry point."""
    from deepseek_ds.cli import main  # every sub-command's module: imported by the tests that run the CLI only

    return main(argv)


def training_loss(model, data_dir: str, step: int, seq_len: int = 128, global_batch: int = 16,
                  micro_batch: int = 8, seed: int = 1234) -> float:
    """The token-weighted (main-model) loss of the global batch that training step `step` used (training's
    TokenWeightedLoss), for a run of the given shape and train.seed (defaults: recipes/tiny-v3.yaml), in the
    references' own data order (reference_data.py)."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for input_ids, labels in step_batch(StreamSamples(data_dir, seq_len), step, global_batch, seed,
                                            micro_batch=micro_batch):
            logits = model(input_ids=input_ids).logits
            total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


def refused(cfg, ds: dict, world: int = 1, match: str | None = None, cuda: bool = False) -> str:
    """validate() must refuse (with a message matching `match`, when given); returns that message."""
    with pytest.raises(ConfigError, match=match) as e:
        validate(cfg, ds, world, cuda_available=cuda)
    return str(e.value)
