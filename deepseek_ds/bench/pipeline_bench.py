"""`deepseek-ds bench pipeline`: pipeline stages x micro-batches sweep.

One `deepspeed` launch per stage count p (world = p x data-parallel size); inside it the worker builds the run
once per micro-batch count m (global batch = m x micro-batch x dp) and times it. Per (p, m): step time,
tokens/s, TFLOP/s, MFU, and the measured bubble next to the 1F1B formula (p-1)/(m+p-1), with every stage's
parameters and memory.

The bubble is measured as the formula defines it: the idle share of the p stages' time in the pipelined
window, 1 - sum over stages of (forward + backward time) / (p x window). The window is stage 0's span from the
start of its first forward to the end of its last backward: in a 1F1B schedule the first stage computes first
and last, so no clocks need to agree across ranks. Gradient reductions and the optimizer step come after the
window (they would be there without a pipeline). The table shows the median over timed steps, averaged over
data-parallel replicas.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from ..config import ConfigError, load_and_validate, load_run_config
from ..launcher.hostfile import count_slots
from ..utils.cli_args import spellings
from ..utils.fmt import human_bytes
from ..utils.system import usable_cpus
from . import report
from .launch import add_launch_args, launch, step_metrics, threads_per_rank
from .load import HostLoad, check_quiet_host
from .report import Column


def bubble_theory(p: int, m: int) -> float:
    """Idle share of a 1F1B (or GPipe) schedule with equal stages and free communication."""
    return (p - 1) / (m + p - 1)


def replica_bubble(stages: list[dict]) -> tuple[float, list[float]]:
    """One pipeline replica's reports, ordered by stage -> (bubble, idle share of each stage), medians over the
    timed steps."""
    p = len(stages)
    bubbles, idles = [], []
    for per_stage in zip(*[[s for s in r["steps"] if s["timed"]] for r in stages]):
        window = max(per_stage[0]["span"], 1e-12)  # stage 0 computes first and last: its span is the window
        bubbles.append(1 - sum(s["compute"] for s in per_stage) / (p * window))
        idles.append([1 - s["compute"] / window for s in per_stage])
    return statistics.median(bubbles), [statistics.median(column) for column in zip(*idles)]


def combination_rows(p: int, m: int, reports: list[dict]) -> tuple[dict, list[dict]]:
    """The (p, m) row and one row per pipeline stage (its data-parallel replicas folded: the fullest one)."""
    replicas = sorted({r["dp_rank"] for r in reports})
    measured = [replica_bubble(sorted((r for r in reports if r["dp_rank"] == d), key=lambda r: r["stage_id"]))
                for d in replicas]
    per_stage = []
    for stage in range(p):
        mine = [r for r in reports if r["stage_id"] == stage]
        held = [r["held"] for r in mine]
        per_stage.append({
            "stages": p, "micro_batches": m, "stage": stage,
            "params": sum(mine[0]["param_numels"]),
            "idle_fraction": statistics.mean(idle[stage] for _, idle in measured),
            "compute_s": statistics.median(s["compute"] for r in mine for s in r["steps"] if s["timed"]),
            "params_bytes": max(h["params"] for h in held), "grads_bytes": max(h["grads"] for h in held),
            "optimizer_bytes": max(h["optimizer"] for h in held),
            "model_states_bytes": max(h["params"] + h["grads"] + h["optimizer"] for h in held),
            "peak_memory_bytes": max(r["peak_memory"] for r in mine),
        })
    r0 = reports[0]
    row = {"model": r0["model"], "stages": p, "micro_batches": m, "ranks": r0["world"], "dp": r0["dp_size"],
           "threads": " / ".join(sorted({str(r["threads"]) for r in reports})),  # as the ranks measured them
           "global_batch_size": r0["global_batch_size"],
           "bubble_measured": statistics.mean(bubble for bubble, _ in measured),
           "bubble_theory": bubble_theory(p, m),
           "stage_params": " / ".join(f"{s['params'] / 1e6:.2f}M" for s in per_stage),
           "stage_memory": " / ".join(human_bytes(s["peak_memory_bytes"]) for s in per_stage),
           "stage_model_states": " / ".join(human_bytes(s["model_states_bytes"]) for s in per_stage)}
    row.update(step_metrics(reports))
    return row, per_stage


# ---------------------------------------------------------------------------------------------- report
COLUMNS = [
    Column("stages", "stages p"), Column("micro_batches", "micro-batches m"), Column("ranks", "ranks"),
    Column("step_time_s", "step time (s)", "{:.3f}"), Column("tokens_per_s_spread", "tokens/s min / median / max"),
    Column("threads", "threads per rank"),
    Column("tflops_per_device", "TFLOP/s per device", "{:.4f}"), Column("mfu", "MFU", "{:.1%}"),
    Column("bubble_measured", "bubble measured", "{:.1%}"), Column("bubble_theory", "(p-1)/(m+p-1)", "{:.1%}"),
    Column("stage_params", "params per stage"), Column("stage_model_states", "model states per stage"),
    Column("stage_memory", "peak memory per stage"),
]
CSV_COLUMNS = [Column(k, k) for k in (
    "stages", "micro_batches", "ranks", "dp", "threads", "global_batch_size", "step_time_s", "step_time_min_s",
    "step_time_max_s", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max",
    "tflops_per_device", "mfu", "bubble_measured", "bubble_theory", "stage_params", "stage_model_states",
    "stage_memory")]
STAGE_CSV_COLUMNS = [Column(k, k) for k in (
    "stages", "micro_batches", "stage", "params", "idle_fraction", "compute_s", "params_bytes", "grads_bytes",
    "optimizer_bytes", "model_states_bytes", "peak_memory_bytes")]


def _plot(rows: list[dict], path: str, key: str, ylabel: str, title: str, theory: bool) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, p in enumerate(sorted({r["stages"] for r in rows})):
        mine = [r for r in rows if r["stages"] == p]
        color = f"C{i}"
        ax.plot([r["micro_batches"] for r in mine], [r[key] for r in mine], "o-", color=color, label=f"p = {p}")
        if theory:
            ax.plot([r["micro_batches"] for r in mine], [r["bubble_theory"] for r in mine], "--", color=color,
                    alpha=0.7, label=f"formula (p-1)/(m+p-1), p = {p}")
    ms = sorted({r["micro_batches"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _notes(rows: list[dict], ranks: list[dict]) -> str:
    cores = usable_cpus()
    crowded = sorted({r["ranks"] for r in rows if r["ranks"] > cores})
    oversubscribed = ""
    if crowded and report.on_cpu(ranks):
        oversubscribed = (
            f"\n\n**Oversubscribed.** This host has {cores} usable cores and ran {', '.join(map(str, crowded))} "
            "ranks at once: the ranks time-share the cores, so compute stretches while neighbours run, waiting "
            "ranks still take CPU, and the measured bubble and throughput of those rows describe the CPU "
            "contention as much as the schedule.")
    memory = ("the process's peak RSS; it cannot be reset, so within one stage count later (larger m) rows "
              "include earlier ones" if report.on_cpu(ranks) else
              "CUDA `max_memory_allocated` of the fullest rank of that stage")
    return f"""\
**Bubble.** Measured as the formula defines it: the idle share of the p stages' time in the pipelined window,
1 - Σ(forward + backward time of each stage) / (p x window), where the window is stage 0's span from the start
of its first forward to the end of its last backward (in DeepSpeed's 1F1B schedule the first stage computes
first and last; gradient reductions and the optimizer step come after it). Idle time is waiting for
activations or gradients, sending them, and loading micro-batches; pipeline_stages.csv has each stage's idle
share. The formula assumes equal stages and free communication, so the measurement sits above it where stages
are unequal (the embedding and the head make the first and last stages different) or messages are slow; at
p = 1 the idle time is the loss and bookkeeping between micro-batches, outside forward/backward.

**Memory.** Model states per stage are the bytes of parameters, gradients and optimizer states the stage's ranks
hold (measured as in `bench zero`); peak memory is {memory}.{oversubscribed}"""


def write_report(rows: list[dict], stage_rows: list[dict], launches: list[list[dict]], out: str,
                 load: HostLoad, threads: int | None) -> list[str]:
    """`launches`: per stage count, its ranks' reports (devices and threads for the environment); `load`: the
    host's load while they ran; `threads`: the torch threads per rank every launch was given (None with a hostfile:
    its hosts' .deepspeed_env decides)."""
    ranks = max(launches, key=len)
    every_rank = [rank for launch in launches for rank in launch]
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f) for k, f in (
        ("md", "pipeline.md"), ("csv", "pipeline.csv"), ("stages", "pipeline_stages.csv"),
        ("throughput", "pipeline_throughput.png"), ("bubble", "pipeline_bubble.png"))}
    report.write_csv(paths["csv"], rows, CSV_COLUMNS)
    report.write_csv(paths["stages"], stage_rows, STAGE_CSV_COLUMNS)
    _plot(rows, paths["throughput"], "tokens_per_s", "tokens/s (all ranks)", "Pipeline throughput", theory=False)
    _plot(rows, paths["bubble"], "bubble_measured", "idle share of the pipelined window",
          "Pipeline bubble: measured (solid) vs formula (dashed)",
          theory=True)
    r = rows[0]
    cpu = report.on_cpu(ranks)
    report.write_markdown(paths["md"], [
        f"# Pipeline stages x micro-batches: {r['model']}", load.banner(),
        f"Ranks = stages x data-parallel size {r['dp']}; each micro-batch {r['micro_batch_size']} sequences of "
        f"{r['seq_len']} tokens, m of them per optimizer step and replica. Step time: median of {r['timed_steps']} "
        "timed steps after warm-up (tokens/s: of the slowest, median and fastest step); tokens/s over all ranks." +
        (" " + report.threads_header(threads, max(r["world"] for r in every_rank)) if cpu and threads else ""),
        report.markdown_table(rows, COLUMNS),
        _notes(rows, ranks) + (report.threads_note(every_rank) if cpu else ""),
        "![throughput](pipeline_throughput.png)\n\n![bubble](pipeline_bubble.png)",
        "## Environment\n\n" + report.environment_markdown(report.environment(every_rank, load)),
    ])
    return list(paths.values())


# ---------------------------------------------------------------------------------------------- driver
def run_pipeline_bench(args: argparse.Namespace
                       ) -> tuple[list[dict], list[dict], list[list[dict]], HostLoad, int | None]:
    """Validate every (p, m), then launch one stage count after the other; returns the rows, the per-stage rows,
    per stage count its ranks' reports, the host's load while they ran and the torch threads per rank."""
    check_quiet_host(args.allow_busy)
    raw = os.path.join(args.out, "raw")
    os.makedirs(raw, exist_ok=True)
    cfg = load_run_config(args.config, args.set)
    plans = []
    for p in args.stages:
        world = count_slots(args.hostfile, args.include, args.exclude) if args.hostfile else p * args.dp
        dp = world // p
        batches = [m * cfg.train.micro_batch_size * dp for m in args.micro_batches]
        sets = args.set + [f"parallel.pipeline_stages={p}", f"train.output_dir={os.path.join(raw, f'pp{p}')}",
                           f"train.steps={len(batches) * (args.warmup + args.steps + 1)}"]
        if args.peak_tflops:
            sets.append(f"train.peak_tflops={args.peak_tflops}")
        for m, gbs in zip(args.micro_batches, batches):  # every combination is checked before the first launch
            try:
                load_and_validate(args.config, args.deepspeed_config, sets + [f"train.global_batch_size={gbs}"], world)
            except ConfigError as e:
                raise ConfigError(f"{p} stages x {m} micro-batches on {world} ranks: {e}") from e
        plans.append((p, world, batches, sets))
    # One number of threads for every row, chosen for the largest launch: a 1-stage row alone on all the cores
    # ran up to 55x slower than with its share (OpenMP's spin-waits stall whenever other work holds a core).
    largest = max(world for _, world, _, _ in plans)
    threads = None if args.hostfile else threads_per_rank(largest)
    rows, stage_rows, launches = [], [], []
    with HostLoad(own_tasks=largest * (threads or 1)) as load:
        for p, world, batches, sets in plans:
            print(f"{p} stage(s): {world} ranks, micro-batches {args.micro_batches}, {args.warmup} + {args.steps} "
                  "steps each ...", flush=True)
            variants = launch(args, world=world, global_batch_sizes=batches, sets=sets,
                              deepspeed_config=args.deepspeed_config, result=os.path.join(raw, f"pp{p}.result.json"),
                              log=os.path.join(raw, f"pp{p}.log"), threads=threads)
            for m, reports in zip(args.micro_batches, variants):
                row, per_stage = combination_rows(p, m, reports)
                rows.append(row)
                stage_rows += per_stage
            launches.append([rank for reports in variants for rank in reports])
    return rows, stage_rows, launches, load, threads


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of positive integers")
    return values


def _bench(args: argparse.Namespace) -> int:
    rows, stage_rows, launches, load, threads = run_pipeline_bench(args)
    paths = write_report(rows, stage_rows, launches, args.out, load, threads)
    print(report.markdown_table(rows, COLUMNS))
    if load.busy:
        print(f"warning: the host was busy while the benchmark ran ({load.describe()})", file=sys.stderr)
    print("wrote " + ", ".join(paths))
    return 0


def register(subparsers) -> None:
    """Add `pipeline` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("pipeline", help="pipeline stages x micro-batches: throughput and measured bubble "
                                               "vs (p-1)/(m+p-1)")
    add_launch_args(p)
    p.add_argument("--stages", type=_ints, default=[1, 2, 4], help="pipeline stage counts (default 1,2,4)")
    p.add_argument(*spellings("--micro-batches"), type=_ints, default=[1, 2, 4, 8, 16],
                   help="micro-batches per optimizer step (default 1,2,4,8,16)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size per stage count (ranks = p x dp); "
                                                     "with --hostfile the hostfile's slots decide")
    p.add_argument("--out", default="runs/bench/pipeline", help="report directory (raw launches under OUT/raw)")
    p.set_defaults(func=_bench)
