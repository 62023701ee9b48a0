"""`deepseek-ds bench comm`: each rank's communication bytes per optimizer step and collective kind, counted on real
runs of several layouts (one `deepspeed` launch each, the real training loop under bench/comm_counter.py), beside
what `plan` predicts for them (plan/comm.py, handed in by the command line: bench does not import plan). Bytes do not
depend on the hardware or the host's load: 2 CPU ranks measure what any cluster moves for the same layout.

Writes OUT/comm.csv (layout, stage, collective, measured_bytes, planned_bytes, ratio), OUT/comm.png and OUT/comm.md;
the runs under OUT/raw/<layout>."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Callable

from ..config import load_and_validate
from ..utils.cli_args import add_run_args, positive_int, spellings
from ..utils.collectives import KINDS
from ..utils.errors import LaunchError, UserError
from ..utils.net import free_port
from ..utils.system import deepspeed_executable, launch_env
from . import report
from .comm_counter import counts_file, read_counts
from .report import Column

# name -> (DeepSpeed JSON, --set values): each parallelism alone on 2 ranks, ZeRO-1 under it.
LAYOUTS = {
    "zero0": ("ds_configs/zero0.json", []),
    "zero1": ("ds_configs/zero1.json", []),
    "zero2": ("ds_configs/zero2.json", []),
    "zero3": ("ds_configs/zero3.json", []),
    "pp2": ("ds_configs/zero1_pp.json", ["parallel.pipeline_stages=2"]),
    "ep2": ("ds_configs/zero1.json", ["parallel.expert_parallel=2"]),
    "tp2": ("ds_configs/zero1.json", ["parallel.tensor_parallel=2"]),
    "sp2": ("ds_configs/zero1.json", ["parallel.sequence_parallel=2"]),
}
COLUMNS = [Column("layout", "layout"), Column("stage", "stage"), Column("collective", "collective"),
           Column("measured_bytes", "measured", "{:,.0f}"), Column("planned_bytes", "planned", "{:,}"),
           Column("ratio", "measured / planned", "{:.4f}")]
# The first steps set up once: ZeRO-3 traces its gathers in step 1 and, at the next forward, converts (broadcasts)
# parameters registered after the engine's start; from this step on every step moves the same bytes.
SETTLED = 3
Planner = Callable[..., list[dict[str, int]]]  # (run config, DeepSpeed JSON, world) -> per stage, bytes by kind


def _layouts(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown layout(s) {', '.join(unknown) or '(none)'}: choose from "
                                         f"{', '.join(LAYOUTS)}")
    return names


def _steps(text: str) -> int:
    steps = positive_int(text)
    if steps < SETTLED:
        raise argparse.ArgumentTypeError(f"{steps}: at least {SETTLED} (steps {SETTLED}.. are compared; the first ones "
                                         "set up once)")
    return steps


def _tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def measure(args: argparse.Namespace, name: str, planned: Planner) -> list[dict]:
    """One layout: validated and planned here, launched, its ranks' counts of steps 2..steps averaged per stage."""
    ds_config, layout_sets = LAYOUTS[name]
    out = os.path.join(args.out, "raw", name)
    sets = [*args.set, *layout_sets, f"train.steps={args.steps}", "checkpoint.interval=0", "eval.interval=0",
            f"train.output_dir={os.path.abspath(out)}"]
    try:
        cfg, ds = load_and_validate(args.config, ds_config, sets, args.num_gpus)
    except UserError as e:
        raise UserError(f"bench comm: layout {name} ({ds_config} {' '.join(layout_sets)}): {e}") from e
    plan = planned(cfg, ds, args.num_gpus)
    shutil.rmtree(out, ignore_errors=True)  # a run directory with checkpoints would resume, not train
    os.makedirs(out)
    cmd = [deepspeed_executable(), "--master_port", str(free_port()), "--num_gpus", str(args.num_gpus),
           "--module", "deepseek_ds.bench.comm_counter", "--config", args.config, "--deepspeed_config", ds_config]
    for s in sets:
        cmd += ["--set", s]
    log = out + ".log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=launch_env(), timeout=args.timeout,
                                start_new_session=True).returncode
        except subprocess.TimeoutExpired as e:
            raise LaunchError(f"bench comm: {name} ran past --timeout {args.timeout:.0f} s; log: {log}") from e
    if rc != 0:
        raise LaunchError(f"bench comm: {name}'s launch exited with {rc}; last lines of {log}:\n{_tail(log)}")
    counts = [read_counts(counts_file(out, rank)) for rank in range(args.num_gpus)]
    steps = range(SETTLED, args.steps + 1)
    per_stage = args.num_gpus // len(plan)
    rows = []
    for stage, kinds in enumerate(plan):
        mine = counts[stage * per_stage:(stage + 1) * per_stage]
        seen = {k for c in mine for s in steps for k in c.get(s, {})}
        for kind in [k for k in KINDS if k in seen or kinds.get(k)]:
            measured = sum(c.get(s, {}).get(kind, 0) for c in mine for s in steps) / (len(mine) * len(steps))
            want = kinds.get(kind, 0)
            rows.append({"layout": name, "stage": stage, "collective": kind, "measured_bytes": measured,
                         "planned_bytes": want, "ratio": measured / want if want else None})
    return rows


def plot(rows: list[dict], path: str) -> None:
    plt = report.pyplot()
    labels = [f"{r['layout']}{'/' + str(r['stage']) if r['stage'] else ''} {r['collective']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(7, 0.45 * len(rows)), 4.5), dpi=110)
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured_bytes"] for r in rows], width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["planned_bytes"] for r in rows], width=0.4, label="plan")
    ax.set_yscale("log")
    ax.set_ylabel("bytes per rank and optimizer step")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _bench(args: argparse.Namespace, planned: Planner) -> int:
    os.makedirs(args.out, exist_ok=True)
    rows = [row for name in args.layouts for row in measure(args, name, planned)]
    report.write_csv(os.path.join(args.out, "comm.csv"), rows, COLUMNS)
    plot(rows, os.path.join(args.out, "comm.png"))
    table = report.markdown_table(rows, COLUMNS)
    worst = max((abs(r["ratio"] - 1) for r in rows if r["ratio"] is not None), default=0.0)
    unplanned = [r for r in rows if r["ratio"] is None]
    what = (f"Each rank's bytes per optimizer step by collective kind on {args.num_gpus} ranks, the mean of steps "
            f"{SETTLED}-{args.steps} (the first ones set up once: ZeRO-3 traces its gathers, converts late "
            "parameters) and of a pipeline stage's ranks (expert-parallel routing splits the all-to-alls unevenly "
            "between ranks; their sum is fixed), counted by deepseek_ds/bench/comm_counter.py (the tensor bytes a "
            "call passes: an all-reduce's tensor, a reduce-scatter's input, an all-gather's output, an all-to-all's "
            "input, the tensors a rank sends), beside plan's model (deepseek_ds/plan/comm.py). Bytes do not depend "
            "on the machine or its load: the busy shared host this ran on changes times, not these numbers.")
    summary = (f"Largest deviation from the plan: {worst:.3%}" +
               (f"; {len(unplanned)} rows the plan does not predict" if unplanned else "") + ".")
    report.write_process_report(os.path.join(args.out, "comm.md"), "Communication bytes: measured vs plan", what,
                                [summary, table, "![bytes](comm.png)"], ranks=args.num_gpus)
    print(table)
    print(summary)
    print(f"report: {os.path.join(args.out, 'comm.md')}")
    return 0 if worst <= 0.02 and not unplanned else 1


def register(subparsers, planned: Planner) -> None:
    """Add `comm` to the `deepseek-ds bench` group; `planned`: plan's bytes of a (run config, JSON, world)."""
    p = subparsers.add_parser("comm", help="communication bytes per collective, measured on real runs of several "
                                           "layouts vs what plan predicts")
    add_run_args(p, set_help="override the run YAML for every layout (repeatable)", deepspeed_config=False)
    p.add_argument("--layouts", type=_layouts, default=list(LAYOUTS),
                   help=f"comma-separated, from {','.join(LAYOUTS)} (default: all)")
    p.add_argument(*spellings("--num_gpus"), type=positive_int, default=2, help="local ranks per launch (default 2)")
    p.add_argument("--steps", type=_steps, default=4,
                   help=f"optimizer steps per layout, at least {SETTLED}; steps {SETTLED}.. are compared (default 4)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one launch may take (default 900)")
    p.add_argument("--out", default="runs/bench/comm", help="report directory (default runs/bench/comm)")
    p.set_defaults(func=lambda args: _bench(args, planned))
