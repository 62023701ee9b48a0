"""`deepseek-ds bench pipeline`: pipeline schedules x stages x micro-batches sweep.

One `deepspeed` launch per schedule (parallel.pipeline_schedule: 1f1b, zb-h1, dualpipev; --schedules) and stage
count p (world = p x data-parallel size); inside it the worker builds the run once per micro-batch count m (global
batch = m x micro-batch x dp) and times it. Per (schedule, p, m): step time (median, fastest and slowest timed
step), tokens/s, TFLOP/s, MFU, the measured bubble next to the schedule's formula and the schedule's order run with
the measured stage times, and per stage its parameters, memory and peak activation bytes. p = 1 has no pipeline: it
is launched once, as 1f1b.

The bubble is measured as the formulas define it: the idle share of the p ranks' time in the pipelined window,
1 - Σ over ranks of compute time / (p x window), compute being the forwards and backwards (zb-h1's input and weight
halves too). The window runs from the first rank's first forward to the last rank's last compute. Every rank times
its calls on time.perf_counter (CLOCK_MONOTONIC, one clock for the processes of a host), so when a replica's ranks
share a host the window is taken across them; across hosts it is stage 0's span. That is the window in 1F1B and
DeepSpeed's DualPipeV, where rank 0 computes first and last, but not in ZB-H1 where the weight halves cost more
than the input halves: the last stage's trailing weight halves end after the first stage. Gradient reductions and
the optimizer step come after the window (they would be there without a pipeline). The table shows the median over
timed steps, averaged over data-parallel replicas.

The formulas (parallel/schedule_model.py derives them, with sources), with F, B = I + W per micro-batch and stage:
1F1B (p-1)/(m+p-1) (Narayanan et al. 2021); ZB-H1 bubble time (p-1) max(F+I-W, I, F), which is the zero-bubble
paper's (p-1)(F+B-2W) (Qi et al. 2024) while W <= I and I <= F, in a window of m(F+B) plus it; DualPipeV as
DeepSpeed runs it, forward and backward one after the other, weight gradients inside the backward, sends batched
with the next operation's (not DeepSeek's DualPipe README's (PP/2-1)(F&B+B-3W), which overlaps and defers):
max((p-1)(F+2B) - F, (p-1)(2F+B), (2p-1)F + (p-2)B) for half-stage F and B, in a window of 2m(F+B) plus it. Each
row evaluates its formula with the measured per-micro-batch times (the worker times every instruction): the mean F,
I, W of the stages after the first (whose input half is its whole backward) for zb-h1, of all half stages for
dualpipev. The "model" column runs the schedule's real instruction order with each stage's own measured times and
free communication (parallel/schedule_model.simulate): the formula's gap to it is unequal stages, the measurement's
gap to the model is communication, loading and bookkeeping.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from ..config import ConfigError, load_and_validate, load_run_config
from ..config.schema import PIPELINE_SCHEDULES
from ..launcher.hostfile import count_slots
from ..parallel import schedule_model
from ..parallel.schedule_rules import min_micro_batches
from ..utils.cli_args import spellings
from ..utils.fmt import human_bytes
from ..utils.system import usable_cpus
from . import report
from .launch import add_launch_args, launch, step_metrics, threads_per_rank
from .load import HostLoad, check_quiet_host
from .report import Column

MARKERS = {"1f1b": "o", "zb-h1": "s", "dualpipev": "^"}


def _window(per_stage: list[dict], common_clock: bool) -> float:
    if common_clock:
        return max(s["last"] for s in per_stage) - min(s["first"] for s in per_stage)
    return per_stage[0]["span"]


def replica_bubble(stages: list[dict]) -> tuple[float, list[float]]:
    """One pipeline replica's reports, ordered by stage -> (bubble, idle share of each stage), medians over the
    timed steps. The window: across the ranks when they share a host's clock, else stage 0's span."""
    p = len(stages)
    common_clock = len({r.get("host") for r in stages}) == 1 and stages[0].get("host") is not None
    bubbles, idles = [], []
    for per_stage in zip(*[[s for s in r["steps"] if s["timed"]] for r in stages]):
        window = max(_window(per_stage, common_clock), 1e-12)
        bubbles.append(1 - sum(s["compute"] for s in per_stage) / (p * window))
        idles.append([1 - s["compute"] / window for s in per_stage])
    return statistics.median(bubbles), [statistics.median(column) for column in zip(*idles)]


def stage_times(schedule: str, p: int, reports: list[dict]) -> dict[int, dict[str, float]]:
    """Seconds per micro-batch of each stage's forward "F", backward "B" (zb-h1: its input half) and weight half
    "W" (zb-h1; else 0), medians over the timed steps of every replica; DualPipeV's 2p half stages by their phase."""
    samples: dict[int, dict[str, list[float]]] = {}
    for r in reports:
        for step in (s for s in r["steps"] if s["timed"]):
            for key, (seconds, calls) in step["instructions"].items():
                name, _, phase = key.partition("/")
                part = r["stage_id"] if phase in ("", "0") else 2 * p - 1 - r["stage_id"]
                op = {"ForwardPass": "F", "BackwardPass": "B", "BackwardInput": "B", "BackwardWeight": "W"}[name]
                samples.setdefault(part, {}).setdefault(op, []).append(seconds / calls)
    parts = 2 * p if schedule == "dualpipev" else p
    return {part: {op: statistics.median(samples[part][op]) if op in samples[part] else 0.0 for op in "FBW"}
            for part in range(parts)}


def schedule_bubbles(schedule: str, p: int, m: int, times: dict[int, dict[str, float]]) -> tuple[float, float]:
    """(the schedule's formula at the measured mean times, its order run with each stage's measured times)."""
    if p == 1:
        return 0.0, 0.0

    def mean(op: str, parts) -> float:
        return statistics.mean(times[part][op] for part in parts)

    if schedule == "zb-h1":
        later = range(1, p)  # the first stage's input half is its whole backward
        formula = schedule_model.bubble(schedule, p, m, mean("F", later), mean("B", later), mean("W", later))
    else:  # bubble() takes a whole stage's times: DualPipeV's two half stages, 1F1B's (its formula has none)
        scale = 2 if schedule == "dualpipev" else 1
        formula = schedule_model.bubble(schedule, p, m, scale * mean("F", times), scale * mean("B", times), 0.0)
    return formula, schedule_model.simulate(schedule, p, m, times)


def combination_rows(schedule: str, p: int, m: int, reports: list[dict]) -> tuple[dict, list[dict]]:
    """The (schedule, p, m) row and one row per pipeline stage (its data-parallel replicas folded: the fullest
    one)."""
    replicas = sorted({r["dp_rank"] for r in reports})
    measured = [replica_bubble(sorted((r for r in reports if r["dp_rank"] == d), key=lambda r: r["stage_id"]))
                for d in replicas]
    times = stage_times(schedule, p, reports) if p > 1 else {}
    per_stage = []
    for stage in range(p):
        mine = [r for r in reports if r["stage_id"] == stage]
        held = [r["held"] for r in mine]
        parts = schedule_model.parts(schedule, p, stage)
        per_stage.append({
            "schedule": schedule, "stages": p, "micro_batches": m, "stage": stage,
            "params": sum(mine[0]["param_numels"]),
            "idle_fraction": statistics.mean(idle[stage] for _, idle in measured),
            "compute_s": statistics.median(s["compute"] for r in mine for s in r["steps"] if s["timed"]),
            **{f"{name}_s": sum(times[part][op] for part in parts) if times else None
               for op, name in (("F", "forward"), ("B", "backward"), ("W", "weight_grad"))},
            "params_bytes": max(h["params"] for h in held), "grads_bytes": max(h["grads"] for h in held),
            "optimizer_bytes": max(h["optimizer"] for h in held),
            "model_states_bytes": max(h["params"] + h["grads"] + h["optimizer"] for h in held),
            "peak_activations_bytes": max(r["peak_activations"] for r in mine),
            "peak_memory_bytes": max(r["peak_memory"] for r in mine),
        })
    formula, model = schedule_bubbles(schedule, p, m, times)
    r0 = reports[0]
    row = {"model": r0["model"], "schedule": schedule, "stages": p, "micro_batches": m, "ranks": r0["world"],
           "dp": r0["dp_size"],
           "threads": " / ".join(sorted({str(r["threads"]) for r in reports})),  # as the ranks measured them
           "global_batch_size": r0["global_batch_size"],
           "bubble_measured": statistics.mean(bubble for bubble, _ in measured),
           "bubble_formula": formula, "bubble_model": model,
           "stage_params": " / ".join(f"{s['params'] / 1e6:.2f}M" for s in per_stage),
           "stage_activations": " / ".join(human_bytes(s["peak_activations_bytes"]) for s in per_stage),
           "stage_memory": " / ".join(human_bytes(s["peak_memory_bytes"]) for s in per_stage),
           "stage_model_states": " / ".join(human_bytes(s["model_states_bytes"]) for s in per_stage)}
    row.update(step_metrics(reports))
    row["step_time_spread"] = " / ".join(f"{row[k]:.3f}" for k in ("step_time_min_s", "step_time_s",
                                                                  "step_time_max_s"))
    return row, per_stage


# ---------------------------------------------------------------------------------------------- report
COLUMNS = [
    Column("schedule", "schedule"), Column("stages", "stages p"), Column("micro_batches", "micro-batches m"),
    Column("ranks", "ranks"), Column("step_time_spread", "step time (s) min / median / max"),
    Column("tokens_per_s_spread", "tokens/s min / median / max"), Column("threads", "threads per rank"),
    Column("tflops_per_device", "TFLOP/s per device", "{:.4f}"), Column("mfu", "MFU", "{:.1%}"),
    Column("bubble_measured", "bubble measured", "{:.1%}"), Column("bubble_formula", "formula", "{:.1%}"),
    Column("bubble_model", "model", "{:.1%}"),
    Column("stage_params", "params per stage"), Column("stage_model_states", "model states per stage"),
    Column("stage_activations", "peak activations per stage"), Column("stage_memory", "peak memory per stage"),
]
CSV_COLUMNS = [Column(k, k) for k in (
    "schedule", "stages", "micro_batches", "ranks", "dp", "threads", "global_batch_size", "step_time_s",
    "step_time_min_s", "step_time_max_s", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max",
    "tflops_per_device", "mfu", "bubble_measured", "bubble_formula", "bubble_model", "stage_params",
    "stage_model_states", "stage_activations", "stage_memory")]
STAGE_CSV_COLUMNS = [Column(k, k) for k in (
    "schedule", "stages", "micro_batches", "stage", "params", "idle_fraction", "compute_s", "forward_s",
    "backward_s", "weight_grad_s", "params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes",
    "peak_activations_bytes", "peak_memory_bytes")]


def _plot(rows: list[dict], path: str, key: str, ylabel: str, title: str, theory: bool) -> None:
    """A line per (schedule, p): one colour per p, one marker per schedule; `theory`: each one's formula dashed."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    colors = {p: f"C{i}" for i, p in enumerate(sorted({r["stages"] for r in rows}))}
    for schedule, p in sorted({(r["schedule"], r["stages"]) for r in rows}, key=lambda sp: (sp[1], sp[0])):
        mine = [r for r in rows if r["stages"] == p and r["schedule"] == schedule]
        ms = [r["micro_batches"] for r in mine]
        ax.plot(ms, [r[key] for r in mine], "-", marker=MARKERS[schedule], color=colors[p],
                label=f"{schedule}, p = {p}")
        if theory:
            ax.plot(ms, [r["bubble_formula"] for r in mine], "--", marker=MARKERS[schedule], fillstyle="none",
                    color=colors[p], alpha=0.7, label=f"{schedule} formula, p = {p}")
    ms = sorted({r["micro_batches"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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
**Bubble.** Measured as the formulas define it: the idle share of the p ranks' time in the pipelined window,
1 - Σ(compute time of each rank) / (p x window), compute being the forwards and backwards (zb-h1's input and weight
halves too); the window runs from the first rank's first forward to the last rank's last compute, on the host's
clock (across hosts: stage 0's span). Gradient reductions and the optimizer step come after it. Idle time is
waiting for activations or gradients, sending them, and loading micro-batches; pipeline_stages.csv has each stage's
idle share and its forward, backward and weight-gradient seconds per micro-batch.

**Formula** is the schedule's, at the measured mean times per micro-batch, with equal stages and free
communication: 1f1b (p-1)/(m+p-1); zb-h1 bubble time (p-1) max(F+I-W, I, F) (the zero-bubble paper's
(p-1)(F+B-2W) while W <= I <= F) over m(F+I+W) plus it; dualpipev, as DeepSpeed runs it (no overlapped forward and
backward, no deferred weight gradients, batched sends), max((p-1)(F+2B) - F, (p-1)(2F+B), (2p-1)F + (p-2)B) per
half stage over 2m(F+B) plus it. **Model** runs the schedule's own instruction order with each stage's measured
times and free communication: the formula sits below it where stages are unequal (the embedding and the head make
the first and last stages different), the measurement above it by the communication, loading and bookkeeping. At
p = 1 (no pipeline, launched once, as 1f1b) the idle time is the loss and bookkeeping between micro-batches.

**Memory.** Model states per stage are the bytes of parameters, gradients and optimizer states the stage's ranks
hold (measured as in `bench zero`); peak activations the most bytes autograd kept for backward at once during a
step (saved-tensor hooks: the schedule's micro-batches in flight; parameters not counted, nor what a checkpointed
region recomputes); peak memory is {memory}.{oversubscribed}"""


def write_report(rows: list[dict], stage_rows: list[dict], launches: list[list[dict]], out: str,
                 load: HostLoad, threads: int | None) -> list[str]:
    """`launches`: per launch (schedule and stage count), its ranks' reports (devices and threads for the
    environment); `load`: the host's load while they ran; `threads`: the torch threads per rank every launch was
    given (None with a hostfile: its hosts' .deepspeed_env decides)."""
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
          "Pipeline bubble: measured (solid) vs each schedule's formula (dashed)",
          theory=True)
    r = rows[0]
    cpu = report.on_cpu(ranks)
    report.write_markdown(paths["md"], [
        f"# Pipeline schedules x stages x micro-batches: {r['model']}", load.banner(),
        f"Ranks = stages x data-parallel size {r['dp']}; each micro-batch {r['micro_batch_size']} sequences of "
        f"{r['seq_len']} tokens, m of them per optimizer step and replica. Step time: the fastest, median and slowest "
        f"of {r['timed_steps']} timed steps after warm-up (tokens/s: of the slowest, median and fastest step); "
        "tokens/s over all ranks." +
        (" " + report.threads_header(threads, max(r["world"] for r in every_rank)) if cpu and threads else ""),
        report.markdown_table(rows, COLUMNS),
        _notes(rows, ranks) + (report.threads_note(every_rank) if cpu else ""),
        "![throughput](pipeline_throughput.png)\n\n![bubble](pipeline_bubble.png)",
        "## Environment\n\n" + report.environment_markdown(report.environment(every_rank, load)),
    ])
    return list(paths.values())


# ---------------------------------------------------------------------------------------------- driver
def check_schedules(schedules: list[str], stages: list[int], micro_batches: list[int]) -> None:
    """Refuse, in one line, a schedule this toolkit lacks or one that cannot run at a (p, m) asked for."""
    unknown = [s for s in schedules if s not in PIPELINE_SCHEDULES]
    if unknown:
        raise ConfigError(f"--schedules {','.join(unknown)}: unknown; use {', '.join(PIPELINE_SCHEDULES)}")
    for schedule in schedules:
        for p in stages:
            fewest = min_micro_batches(schedule, p)
            short = [m for m in micro_batches if m < fewest]
            if short:
                raise ConfigError(f"--schedules {schedule} at {p} stages needs at least {fewest} micro-batches "
                                  f"(--micro-batches has {','.join(map(str, short))})")


def run_pipeline_bench(args: argparse.Namespace
                       ) -> tuple[list[dict], list[dict], list[list[dict]], HostLoad, int | None]:
    """Validate every (schedule, p, m), then launch one (schedule, stage count) after the other; returns the rows,
    the per-stage rows, per launch its ranks' reports, the host's load while they ran and the torch threads per
    rank."""
    check_schedules(args.schedules, args.stages, args.micro_batches)
    check_quiet_host(args.allow_busy)
    raw = os.path.join(args.out, "raw")
    os.makedirs(raw, exist_ok=True)
    cfg = load_run_config(args.config, args.set)
    # p = 1 has no pipeline, the same whatever the schedule: launched once, as 1f1b.
    runs = [(schedule, p) for schedule in args.schedules for p in args.stages if p > 1]
    runs = [("1f1b", 1)] * (1 in args.stages) + runs
    plans = []
    for schedule, p in runs:
        world = count_slots(args.hostfile, args.include, args.exclude) if args.hostfile else p * args.dp
        dp = world // p
        batches = [m * cfg.train.micro_batch_size * dp for m in args.micro_batches]
        name = f"pp{p}" if schedule == "1f1b" else f"pp{p}-{schedule}"
        sets = args.set + [f"parallel.pipeline_stages={p}", f"parallel.pipeline_schedule={schedule}",
                           f"train.output_dir={os.path.join(raw, name)}",
                           f"train.steps={len(batches) * (args.warmup + args.steps + 1)}"]
        if args.peak_tflops:
            sets.append(f"train.peak_tflops={args.peak_tflops}")
        for m, gbs in zip(args.micro_batches, batches):  # every combination is checked before the first launch
            try:
                load_and_validate(args.config, args.deepspeed_config, sets + [f"train.global_batch_size={gbs}"], world)
            except ConfigError as e:
                raise ConfigError(f"{schedule}, {p} stages x {m} micro-batches on {world} ranks: {e}") from e
        plans.append((schedule, p, name, world, batches, sets))
    # One number of threads for every row, chosen for the largest launch: a 1-stage row alone on all the cores
    # ran up to 55x slower than with its share (OpenMP's spin-waits stall whenever other work holds a core).
    largest = max(world for *_, world, _, _ in plans)
    threads = None if args.hostfile else threads_per_rank(largest)
    rows, stage_rows, launches = [], [], []
    with HostLoad(own_tasks=largest * (threads or 1)) as load:
        for schedule, p, name, world, batches, sets in plans:
            print(f"{schedule}, {p} stage(s): {world} ranks, micro-batches {args.micro_batches}, {args.warmup} + "
                  f"{args.steps} steps each ...", flush=True)
            variants = launch(args, world=world, global_batch_sizes=batches, sets=sets,
                              deepspeed_config=args.deepspeed_config, result=os.path.join(raw, f"{name}.result.json"),
                              log=os.path.join(raw, f"{name}.log"), threads=threads)
            for m, reports in zip(args.micro_batches, variants):
                row, per_stage = combination_rows(schedule, p, m, reports)
                rows.append(row)
                stage_rows += per_stage
            launches.append([rank for reports in variants for rank in reports])
    return rows, stage_rows, launches, load, threads


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of positive integers")
    return values


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


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
    p = subparsers.add_parser("pipeline", help="pipeline schedules x stages x micro-batches: throughput, measured "
                                               "bubble vs each schedule's formula, activation memory")
    add_launch_args(p)
    p.add_argument("--schedules", type=_names, default=["1f1b"],
                   help=f"parallel.pipeline_schedule values, comma-separated ({', '.join(PIPELINE_SCHEDULES)}; "
                        "default 1f1b)")
    p.add_argument("--stages", type=_ints, default=[1, 2, 4], help="pipeline stage counts (default 1,2,4)")
    p.add_argument(*spellings("--micro-batches"), type=_ints, default=[1, 2, 4, 8, 16],
                   help="micro-batches per optimizer step (default 1,2,4,8,16)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size per stage count (ranks = p x dp); "
                                                     "with --hostfile the hostfile's slots decide")
    p.add_argument("--out", default="runs/bench/pipeline", help="report directory (raw launches under OUT/raw)")
    p.set_defaults(func=_bench)
