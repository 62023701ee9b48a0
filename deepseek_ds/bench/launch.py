"""The driver side of the benchmarks: launch the per-rank worker (bench/worker.py) with the `deepspeed` launcher,
collect every rank's report, and turn reports into speed numbers."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess

from ..utils.cli_args import add_hostfile, add_master_port, add_run_args, add_slot_filters, spellings
from ..utils.errors import LaunchError
from ..utils.net import free_port
from ..utils.system import cpu_threads_per_rank, deepspeed_executable, launch_env
from .load import add_allow_busy

WORKER_MODULE = "deepseek_ds.bench.worker"


def add_launch_args(p: argparse.ArgumentParser, *, steps: int = 5, warmup: int = 2) -> None:
    """Options every benchmark shares: the run, how to launch it, how long to measure (`steps` and `warmup`: the
    defaults, fewer where each step is slow)."""
    add_run_args(p, set_help="override the run YAML, e.g. --set model.overrides.num_hidden_layers=2 (repeatable)")
    add_hostfile(p, help="DeepSpeed hostfile: launch on its hosts and slots (default: this host)")
    add_slot_filters(p)
    add_master_port(p, help="rendezvous port (default: a free local port)")
    p.add_argument(*spellings("--launcher-args"), default="", metavar="ARGS",
                   help='more `deepspeed` launcher options, given with "=": --launcher-args="--master_addr node-0" '
                        "(default: none)")
    p.add_argument("--steps", type=int, default=steps,
                   help=f"timed optimizer steps per configuration (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed optimizer steps before them (default {warmup})")
    p.add_argument(*spellings("--peak-tflops"), type=float, default=None,
                   help="per-device peak for MFU (default: the known GPU's bf16 dense peak; none on CPU)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one launch may take (default 3600)")
    add_allow_busy(p)


def step_metrics(reports: list[dict]) -> dict:
    """Speed of one configuration from its ranks' reports: the median over timed steps of the slowest rank's
    step time (every rank waits for it) with the fastest and slowest such step (the spread), tokens/s over all
    ranks (likewise), TFLOP/s per device and MFU (of the median)."""
    r0 = reports[0]
    per_step = [max(times) for times in zip(*[[s["seconds"] for s in r["steps"] if s["timed"]] for r in reports])]
    step_time = statistics.median(per_step)
    tokens = r0["global_batch_size"] * r0["seq_len"]
    tflops = r0["flops_per_token"] * tokens / step_time / r0["world"] / 1e12
    fastest, slowest = min(per_step), max(per_step)
    return {"step_time_s": step_time, "step_time_min_s": fastest, "step_time_max_s": slowest,
            "tokens_per_s": tokens / step_time, "tokens_per_s_min": tokens / slowest,
            "tokens_per_s_max": tokens / fastest,
            "tokens_per_s_spread": f"{tokens / slowest:,.0f} / {tokens / step_time:,.0f} / {tokens / fastest:,.0f}",
            "tflops_per_device": tflops,
            "mfu": tflops / r0["peak_tflops"] if r0["peak_tflops"] else None,
            "timed_steps": sum(s["timed"] for s in r0["steps"]), "micro_batch_size": r0["micro_batch_size"],
            "grad_accum": r0["grad_accum"], "seq_len": r0["seq_len"]}


def _tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def worker_command(args: argparse.Namespace, *, world: int, global_batch_sizes: list[int], sets: list[str],
                   deepspeed_config: str | None, result: str) -> list[str]:
    cmd = [deepspeed_executable(), "--master_port", str(args.master_port or free_port())]
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
        cmd += ["--include", args.include] if args.include else []
        cmd += ["--exclude", args.exclude] if args.exclude else []
    else:
        cmd += ["--num_gpus", str(world)]
    cmd += shlex.split(args.launcher_args)
    cmd += ["--module", WORKER_MODULE, "--config", args.config, "--result", os.path.abspath(result),
            "--global-batch-sizes", ",".join(map(str, global_batch_sizes)),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if deepspeed_config:
        cmd += ["--deepspeed_config", deepspeed_config]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _run(cmd: list[str], env: dict[str, str], log: str, timeout: float) -> int | None:
    """The launcher's exit status, or None when it ran past `timeout` (then it and its ranks are stopped)."""
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        # Own session, so that the launcher and its ranks can be stopped together, and nothing else.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:  # timed out, or we were interrupted (Ctrl-C): the ranks stop with us
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)


def threads_per_rank(max_local_ranks: int) -> int:
    """The torch threads every rank of every configuration of one benchmark runs with: the usable cores divided
    by the largest launch's local ranks (OMP_NUM_THREADS, when set, wins). One number for all rows, or a 1-rank
    row would compute on all the cores while a 2-rank row shares them, and OpenMP's spin-waiting threads of a rank
    alone on all the cores stall whenever other work holds one (a 1-rank pipeline row ran 55x slower so)."""
    return cpu_threads_per_rank(max_local_ranks)


def launch(args: argparse.Namespace, *, world: int, global_batch_sizes: list[int], sets: list[str],
           deepspeed_config: str | None, result: str, log: str, threads: int | None) -> list[list[dict]]:
    """One `deepspeed` launch of the worker (on `world` local ranks, or on the hostfile's slots); returns, per
    global batch size, every rank's report. The launcher's output goes to `log`. `threads`: OpenMP threads per
    local rank (threads_per_rank() of the benchmark's largest launch; None only with a hostfile, whose hosts'
    .deepspeed_env decides); OMP_NUM_THREADS, when set, wins."""
    cmd = worker_command(args, world=world, global_batch_sizes=global_batch_sizes, sets=sets,
                         deepspeed_config=deepspeed_config, result=result)
    env = launch_env()
    if threads and not args.hostfile and "OMP_NUM_THREADS" not in env:
        # Share the cores among the local ranks. With the default (every rank one thread per
        # core) OpenMP's spin-waiting threads of co-located ranks starve each other: ZeRO-0 ran ~30x slower
        # on a 2-core host. On other hosts of a hostfile, set it in .deepspeed_env.
        env["OMP_NUM_THREADS"] = str(threads)
    if os.path.exists(result):
        os.remove(result)
    rc = _run(cmd, env, log, args.timeout)
    if rc is None:
        raise LaunchError(f"launch timed out after {args.timeout:.0f} s (--timeout); log: {log}\n{_tail(log)}")
    if rc != 0:
        raise LaunchError(f"launch exited with {rc}; last lines of {log}:\n{_tail(log)}")
    if not os.path.exists(result):
        raise LaunchError(f"rank 0 wrote no {result}: with --hostfile run the bench on the first host, or on a "
                          f"filesystem every host shares; log: {log}")
    with open(result) as f:
        return json.load(f)["variants"]
