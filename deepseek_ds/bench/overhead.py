"""`deepseek-ds bench overhead`: the toolkit's training step against what it could be and what users pick instead.

1 rank: our loop step (the step and every metric of metrics.jsonl) against a bare transformers + torch.optim.AdamW
loop, and against the bare DeepSpeed engine (a second run of the same config: its engine's forward, loss, backward
and step alone, so what the toolkit adds around the engine), on the same initial weights, global batches and threads,
alternating step by step in one process (eager, and with --compile also both regionally compiled). 2 ranks: our
step against transformers.Trainer with its DeepSpeed integration (on CUDA and on CPU alike: a DeepSpeedEngine at the
JSON's ZeRO stage, checked) on the same model, batch shape and DeepSpeed JSON; Trainer's steps alternate with ours
too (ours runs in its step-end callback). Ratios are reference step time / our step time: above 1 we are faster.
Each ratio comes from one launch, side by side, because a shared host's load changes from minute to minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

from ..utils.cli_args import add_run_args, spellings
from ..utils.errors import LaunchError
from ..utils.net import free_port
from ..utils.system import deepspeed_executable, launch_env
from . import report
from .launch import _run, _tail, threads_per_rank
from .load import HostLoad, add_allow_busy, check_quiet_host
from .report import Column

WORKER_MODULE = "deepseek_ds.bench.overhead_worker"
COLUMNS = [
    Column("reference", "against"), Column("variant", "variant"), Column("ranks", "ranks"),
    Column("ours_s", "our step (s)", "{:.4f}"), Column("reference_s", "reference step (s)", "{:.4f}"),
    Column("ratio", "reference / ours", "{:.3f}"),
    Column("ours_first_loss", "our first loss", "{:.5f}"), Column("reference_first_loss", "its first loss", "{:.5f}"),
]


def _launch(args: argparse.Namespace, world: int, extra: list[str], name: str) -> list[dict]:
    result, log = os.path.join(args.out, f"{name}.json"), os.path.join(args.out, f"{name}.log")
    cmd = [deepspeed_executable(), "--num_gpus", str(world), "--master_port", str(free_port()),
           "--module", WORKER_MODULE, "--config", args.config, "--result", os.path.abspath(result),
           "--warmup", str(args.warmup), "--steps", str(args.steps), *extra,
           "--set", f"train.output_dir={os.path.join(args.out, name)}"]
    if args.deepspeed_config:
        cmd += ["--deepspeed_config", args.deepspeed_config]
    for s in args.set:
        cmd += ["--set", s]
    env = launch_env()
    # One share of the cores per rank, the same in both launches: chosen for the larger (see bench/launch.py).
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(max(1, args.trainer_ranks))))
    rc = _run(cmd, env, log, args.timeout)
    if rc != 0:
        raise LaunchError(f"{name}: launch {'timed out' if rc is None else f'exited with {rc}'}; last lines of "
                          f"{log}:\n{_tail(log)}")
    with open(result) as f:
        return json.load(f)["variants"]


def _row(reference: str, variant: dict, ranks: int, key: str) -> dict:
    timed = [s for s in variant["steps"] if s["timed"]]
    ours, theirs = statistics.median(s["ours_s"] for s in timed), statistics.median(s[f"{key}_s"] for s in timed)
    first = variant["steps"][0]
    return {"reference": reference, "variant": variant["variant"], "ranks": ranks, "ours_s": ours,
            "reference_s": theirs, "ratio": theirs / ours, "ours_first_loss": first["ours_loss"],
            "reference_first_loss": first[f"{key}_loss"], "threads": variant["threads"]}


def rows(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """The table's rows and notes (what the Trainer row ran)."""
    out = [_row(reference, v, 1, key)
           for v in _launch(args, 1, ["--against", "bare", "--compile", args.compile], "bare")
           for reference, key in (("bare transformers + AdamW", "bare"), ("bare DeepSpeed engine", "engine"))]
    trainer = _launch(args, args.trainer_ranks, ["--against", "trainer"], "trainer")
    out += [_row("transformers.Trainer", v, args.trainer_ranks, "trainer") for v in trainer]
    notes = [f"The Trainer row is transformers.Trainer with its DeepSpeed integration: a DeepSpeedEngine at ZeRO stage "
             f"{v['trainer_zero_stage']} over {v['trainer_dp_world_size']} data-parallel ranks (checked in the run), "
             "under the run's DeepSpeed JSON less its scheduler (Trainer's constant learning rate)." for v in trainer]
    return out, notes


def _bench(args: argparse.Namespace) -> int:
    check_quiet_host(args.allow_busy)
    os.makedirs(args.out, exist_ok=True)
    with HostLoad() as load:
        table_rows, notes = rows(args)
    bad = [r for r in table_rows if not all(math.isfinite(r[k]) for k in ("ours_s", "reference_s", "ratio"))]
    if bad:
        raise LaunchError(f"non-finite timings in {bad}")
    table = report.markdown_table(table_rows, COLUMNS)
    print(table)
    for note in notes:
        print("note:", note)
    report.write_csv(os.path.join(args.out, "overhead.csv"), table_rows, COLUMNS)
    ranks = [{"device": "cuda" if torch.cuda.is_available() else "CPU", "threads": r["threads"]} for r in table_rows]
    report.write_markdown(os.path.join(args.out, "overhead.md"), [
        "# bench overhead", load.banner(), __doc__.split("\n\n", 1)[1], table, *notes,
        f"Median over {args.steps} timed steps after {args.warmup} warm-up steps.",
        report.environment_markdown(report.environment(ranks, load))])
    print(f"wrote {os.path.join(args.out, 'overhead.md')}")
    return 0


def register(subparsers) -> None:
    """Add `overhead` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("overhead", help="our training step vs a bare transformers loop and transformers.Trainer")
    add_run_args(p, set_help="override the run YAML, e.g. --set train.micro_batch_size=4 (repeatable)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per comparison (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--compile", choices=("no", "yes", "both"), default="both",
                   help="bare comparison with train.compile off, on, or both (default both)")
    p.add_argument(*spellings("--trainer-ranks"), type=int, default=2,
                   help="ranks of the Trainer comparison (default 2)")
    p.add_argument("--out", default="runs/bench-overhead", help="report directory (default runs/bench-overhead)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one launch may take (default 3600)")
    add_allow_busy(p)
    p.set_defaults(func=_bench)
