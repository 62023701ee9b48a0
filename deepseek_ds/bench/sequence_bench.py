"""`deepseek-ds bench sp`: per-rank memory and speed of sequence parallelism (parallel.sequence_parallel,
DeepSpeed-Ulysses) against the sequence length.

Every (SP degree, sequence length) point is one `deepspeed` launch of the worker (bench/worker.py) on SP ranks
(with --hostfile: its slots, world / SP replicas), micro-batch 1, one sequence per replica per optimizer step.
One launch per point because a process's peak RSS never shrinks: a second point in the same process would
carry the first one's peak. Per point: the fullest rank's peak memory, what it held just before its first
step and the difference, the steps' own increase. That increase is what SP divides (activations of
seq_len / SP tokens per rank, attention over heads / SP heads); the interpreter, libraries, model and
optimizer states are there at any degree. Then, for a memory budget, the longest sequence each degree fits.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..config import ConfigError, load_and_validate, load_run_config
from ..launcher.hostfile import count_slots
from ..utils.cli_args import spellings
from ..utils.errors import LaunchError
from ..utils.fmt import human_bytes, parse_bytes
from . import report
from .launch import add_launch_args, launch, step_metrics, threads_per_rank
from .load import HostLoad, check_quiet_host
from .report import Column

# The target: at this length SP=2's per-rank peak is at most this fraction of SP=1's.
TARGET_SEQ_LEN, TARGET_RATIO = 8192, 0.6


# ---------------------------------------------------------------------------------------------- one point
def point_row(sp: int, reports: list[dict], other_cpu: float | None) -> dict:
    """One point's row: the fullest rank decides whether it fits, so every memory figure is the maximum over
    ranks (the increase too: taken per rank, then the largest)."""
    r0 = reports[0]
    row = {"model": r0["model"], "sp": sp, "ranks": r0["world"], "dp": r0["dp_size"],
           "tokens_per_rank": r0["seq_len"] // sp, "threads": r0["threads"],
           "peak_memory_bytes": max(r["peak_memory"] for r in reports),
           "memory_before_steps_bytes": max(r["memory_before_steps"] for r in reports),
           "peak_before_steps_bytes": max(r["peak_memory_before_steps"] for r in reports),
           "step_increase_bytes": max(r["peak_memory"] - r["memory_before_steps"] for r in reports),
           # ZeRO partitions optimizer states (stage >= 1) over the SP ranks too: DeepSpeed sees them as data-parallel.
           "model_states_bytes": max(r["held"]["params"] + r["held"]["grads"] + r["held"]["optimizer"]
                                     for r in reports),
           "losses": [s["loss"] for s in r0["steps"]], "first_loss": r0["steps"][0]["loss"],
           "last_loss": r0["steps"][-1]["loss"], "other_cpu_share": other_cpu, "tiled_mlp": r0["tiled_mlp"]}
    row.update(step_metrics(reports))
    return row


def compare_losses(rows: list[dict]) -> None:
    """SP changes where tokens are computed, not what: at each length every degree's losses against SP=1's
    (same seed, same sequences; only the order of sums differs)."""
    reference = {r["seq_len"]: r["losses"] for r in rows if r["sp"] == 1}
    for r in rows:
        ref = reference.get(r["seq_len"])
        r["loss_rel_diff"] = (max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref))
                              if ref else None)


# ---------------------------------------------------------------------------------------------- summaries
def longest_fit(rows: list[dict], budget: int) -> dict:
    """The longest measured length whose per-rank peak fits `budget`, and where the next measured length no
    longer fits, a linear interpolation between the two (labelled as such: only measured points are facts)."""
    points = sorted((r["seq_len"], r["peak_memory_bytes"]) for r in rows)
    fitting = [(s, m) for s, m in points if m <= budget]
    if not fitting:
        s, m = points[0]
        return {"sp": rows[0]["sp"], "longest": None, "estimate": None,
                "note": f"none measured: the shortest, {s:,} tokens, needs {human_bytes(m)}"}
    s0, m0 = fitting[-1]
    above = [(s, m) for s, m in points if s > s0 and m > budget]
    if not above:
        return {"sp": rows[0]["sp"], "longest": s0, "estimate": None,
                "note": f"measured ({human_bytes(m0)}); every measured length fits, longer ones were not tried"}
    s1, m1 = above[0]
    estimate = int(s0 + (budget - m0) * (s1 - s0) / (m1 - m0)) if m1 > m0 else s0
    return {"sp": rows[0]["sp"], "longest": s0, "estimate": estimate,
            "note": f"measured {s0:,} ({human_bytes(m0)}); {s1:,} needs {human_bytes(m1)}; ~{estimate:,} "
                    "interpolated linearly between them"}


def ratios(rows: list[dict], seq_len: int) -> dict[int, dict[str, float]]:
    """Per SP degree > 1: its per-rank peak and step increase over SP=1's at `seq_len`."""
    at = {r["sp"]: r for r in rows if r["seq_len"] == seq_len}
    if 1 not in at:
        return {}
    return {sp: {"peak": r["peak_memory_bytes"] / at[1]["peak_memory_bytes"],
                 "increase": r["step_increase_bytes"] / at[1]["step_increase_bytes"],
                 "speed": r["tokens_per_s"] / at[1]["tokens_per_s"]}
            for sp, r in sorted(at.items()) if sp > 1}


# ---------------------------------------------------------------------------------------------- report
COLUMNS = [
    Column("sp", "SP"), Column("ranks", "ranks"), Column("seq_len", "seq len", "{:,}"),
    Column("tokens_per_rank", "tokens / rank", "{:,}"), Column("peak_memory_bytes", "peak / rank", "bytes"),
    Column("memory_before_steps_bytes", "before 1st step / rank", "bytes"),
    Column("step_increase_bytes", "step increase / rank", "bytes"),
    Column("model_states_bytes", "model states / rank", "bytes"),
    Column("step_time_s", "step time (s)", "{:.2f}"), Column("tokens_per_s", "tokens/s", "{:,.0f}"),
    Column("loss_rel_diff", "loss rel. diff vs SP=1", "{:.1e}"),
    Column("other_cpu_share", "other load", "{:.0%}"),
]
CSV_COLUMNS = [Column(k, k) for k in (
    "sp", "ranks", "dp", "threads", "seq_len", "tokens_per_rank", "peak_memory_bytes", "memory_before_steps_bytes",
    "peak_before_steps_bytes", "step_increase_bytes", "model_states_bytes", "step_time_s", "tokens_per_s", "tflops_per_device",
    "timed_steps", "first_loss", "last_loss", "loss_rel_diff", "other_cpu_share", "tiled_mlp")]
FIT_COLUMNS = [Column("sp", "SP"), Column("longest", "longest measured fit", "{:,}"),
               Column("estimate", "interpolated", "{:,}"), Column("note", "how")]


def _by_sp(rows: list[dict]) -> dict[int, list[dict]]:
    return {sp: sorted((r for r in rows if r["sp"] == sp), key=lambda r: r["seq_len"])
            for sp in sorted({r["sp"] for r in rows})}


def _save(plt, fig, ax, rows: list[dict], path: str, ylabel: str, title: str) -> None:
    lengths = sorted({r["seq_len"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{s:,}" for s in lengths])
    ax.minorticks_off()
    ax.set(xlabel="sequence length (tokens)", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_memory(rows: list[dict], budget: int, path: str, cpu: bool) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for i, (sp, mine) in enumerate(_by_sp(rows).items()):
        x = [r["seq_len"] for r in mine]
        ax.plot(x, [r["peak_memory_bytes"] / 2**30 for r in mine], "o-", color=f"C{i}", label=f"SP={sp}: peak")
        ax.plot(x, [r["step_increase_bytes"] / 2**30 for r in mine], "s--", color=f"C{i}", alpha=0.7,
                label=f"SP={sp}: step increase")
    ax.axhline(budget / 2**30, color="grey", linestyle=":", label=f"budget {human_bytes(budget)}")
    _save(plt, fig, ax, rows, path, "GiB per rank",
          f"Per-rank {'peak RSS' if cpu else 'peak CUDA memory'} vs sequence length")


def plot_speed(rows: list[dict], path: str) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, (sp, mine) in enumerate(_by_sp(rows).items()):
        ax.plot([r["seq_len"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", color=f"C{i}",
                label=f"SP={sp} ({mine[0]['ranks']} rank{'s' if mine[0]['ranks'] > 1 else ''})")
    _save(plt, fig, ax, rows, path, "tokens/s (all ranks)", "Throughput vs sequence length")


def ratio_text(rows: list[dict]) -> tuple[str, int | None]:
    """The SP=k / SP=1 sentence at the target length (or, without it, the longest length both measured)."""
    common = sorted({r["seq_len"] for r in rows if r["sp"] == 1} & {r["seq_len"] for r in rows if r["sp"] > 1})
    if not common:
        return "No length was measured at SP=1 and at SP > 1: no ratio.", None
    seq = TARGET_SEQ_LEN if TARGET_SEQ_LEN in common else common[-1]
    lines = []
    for sp, q in ratios(rows, seq).items():
        verdict = "meets" if q["peak"] <= TARGET_RATIO else "misses"
        lines.append(f"- **SP={sp} / SP=1 at {seq:,} tokens**: per-rank peak {q['peak']:.2f}x ({verdict} the "
                     f"{TARGET_RATIO}x target), step increase {q['increase']:.2f}x, tokens/s {q['speed']:.2f}x.")
    return "\n".join(lines), seq


def _conclusion(rows: list[dict], seq: int | None, budget: int, fits: list[dict]) -> str:
    if seq is None:
        return ""
    q = ratios(rows, seq)
    base = {r["sp"]: r for r in rows if r["seq_len"] == seq}
    parts = []
    for sp, x in q.items():
        fixed = base[1]["memory_before_steps_bytes"]
        load = max(base[1]["other_cpu_share"] or 0.0, base[sp]["other_cpu_share"] or 0.0)
        parts.append(
            f"At {seq:,} tokens SP={sp} divides what the steps add per rank by {1 / x['increase']:.1f} (ideal {sp}); "
            f"the absolute peak only by {1 / x['peak']:.2f}, because {human_bytes(fixed)} per rank is there before "
            "any step (interpreter, torch/DeepSpeed, model and optimizer states, communication buckets) and does not "
            f"shrink. On {sp}x the cores its tokens/s is {x['speed']:.2f}x SP=1's (ideal {sp}, less the "
            f"all-to-alls; other work held up to {load:.0%} of the cores during these two launches).")
    fit = "; ".join(f"SP={f['sp']}: {f['longest']:,} tokens" if f["longest"] else f"SP={f['sp']}: none measured"
                    for f in fits)
    return ("**What to conclude.** " + " ".join(parts) + _growth(rows) + " Sequence parallelism pays where "
            "activations dominate the per-rank memory, i.e. long sequences: the longer the sequence, the closer the "
            "peak ratio gets to the step-increase ratio. Within "
            f"{human_bytes(budget)} per rank the longest measured sequence is {fit}.")


def _growth(rows: list[dict]) -> str:
    """How SP=1's step increase grows between its two longest lengths: ~2 means the attention scores are stored."""
    mine = _by_sp(rows).get(1, [])
    if len(mine) < 2:
        return ""
    a, b = mine[-2], mine[-1]
    exponent = math.log(b["step_increase_bytes"] / a["step_increase_bytes"]) / math.log(b["seq_len"] / a["seq_len"])
    if exponent < 1.5:
        return f" The step increase grows about linearly with the length (exponent {exponent:.1f})."
    # Measured with torch 2.13 on CPU: a causal sdpa over 4 heads of 4,096 tokens stores 23 MiB with equal head
    # sizes and ~790 MiB with MLA's (q/k 48, v 32): the math kernel keeps the seq x seq weights for backward.
    return (f" The step increase grows about quadratically with the length (exponent {exponent:.1f} between "
            f"{a['seq_len']:,} and {b['seq_len']:,}): attention stores its seq x seq weights (torch's CPU sdpa takes "
            "its math kernel when the value heads are narrower than the query/key heads, as MLA's are). SP divides "
            "that term too, since each rank attends for heads / SP heads.")


def _threads_note(rows: list[dict]) -> str:
    threads = " or ".join(sorted({str(r["threads"]) for r in rows}))
    how = ("OMP_NUM_THREADS was set for this run" if "OMP_NUM_THREADS" in os.environ else
           "the bench sets OMP_NUM_THREADS to the usable cores divided by the largest SP degree")
    return (f"**Threads.** Every rank ran {threads} torch thread(s) at every degree ({how}): as with one device "
            "per rank, SP=k computes on k times SP=1's cores, and its tokens/s shows what the all-to-alls leave of "
            "that. One thread per core in a single rank would be no fairer on a shared host: OpenMP's spin-waiting "
            "threads stall whenever another process holds a core (measured here: SP=1 at 512 tokens ran ~25x slower "
            "with 2 threads than with 1 while other work kept the 2 cores half busy).")


def _failed_note(failed: list[dict]) -> str:
    if not failed:
        return ""
    return "**Failed launches** (no row above; a rank killed for memory fails so):\n\n" + "\n".join(
        f"- SP={f['sp']}, {f['seq_len']:,} tokens: {f['error']} (`{f['log']}`)" for f in failed)


def write_report(rows: list[dict], failed: list[dict], fits: list[dict], budget: int, ranks: list[dict],
                 out: str, banner: str = "") -> list[str]:
    """`banner`: a busy host's warning (HostLoad.banner()) for the top."""
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f) for k, f in (("md", "sequence.md"), ("csv", "sequence.csv"),
                                                  ("memory", "sequence_memory.png"), ("speed", "sequence_speed.png"))}
    report.write_csv(paths["csv"], rows, CSV_COLUMNS)
    cpu = report.on_cpu(ranks)
    plot_memory(rows, budget, paths["memory"], cpu)
    plot_speed(rows, paths["speed"])
    env = report.environment(ranks)
    devices = env["ranks' devices"]
    machine = f"{env['host CPU']}, {env['host memory']}" + ("" if cpu else f"; ranks on {devices}")
    ratio, seq = ratio_text(rows)
    r = rows[0]
    shared = max(x["other_cpu_share"] or 0.0 for x in rows)
    peak_what = ("the process's peak RSS (`ru_maxrss`), the resident set just before the first step "
                 "(psutil) and their difference" if cpu else
                 "CUDA `max_memory_allocated`, `memory_allocated` just before the first step and their difference")
    report.write_markdown(paths["md"], [block for block in [
        f"# Sequence parallelism (Ulysses) vs sequence length: {r['model']}"
        + (f", tiled MLPs ({r['tiled_mlp']:,} tokens per tile)" if r.get("tiled_mlp") else ""), banner,
        f"Commit `{env['git commit']}`; measured on {machine}, {env['date']}.",
        f"**What was measured.** For each SP degree and sequence length, one `deepspeed` launch on SP ranks x "
        f"{r['dp']} replica(s): micro-batch 1, one sequence per replica per optimizer step, "
        f"{len(r['losses']) - r['timed_steps'] - 1} warm-up step(s), {r['timed_steps']} timed, then one measured "
        f"step (the held model states). Memory per rank is {peak_what}, "
        "the fullest rank's; a launch per point because peak RSS never shrinks within a process. The step "
        "increase holds the activations and, created in the first step, the gradients and Adam states (model "
        "states: the parameter, gradient and optimizer bytes the rank holds, measured as in `bench zero`; ZeRO "
        "partitions the optimizer over the SP ranks as well, which DeepSpeed sees as data-parallel). tokens/s counts "
        "every token of the step's sequences over the median step time of the slowest rank. Losses are compared "
        "with SP=1's at the same length (the same sequences, so only the order of sums may differ). Where the model "
        "has fewer positions than the longest length (the tiny presets: 1,024), model.overrides."
        "max_position_embeddings is raised to it (the default rotary embedding takes any length). "
        "\"other load\" is the share of the host's cores that work other than the launch used meanwhile.",
        report.markdown_table(rows, COLUMNS),
        _failed_note(failed),
        ratio,
        f"**Longest sequence within {human_bytes(budget)} per rank** (absolute peak):\n\n"
        + report.markdown_table(fits, FIT_COLUMNS),
        _conclusion(rows, seq, budget, fits),
        # Memory does not depend on the load; speed does. A few percent is the system's own background.
        (f"**Shared machine.** Other work used up to {shared:.0%} of the host's cores during a launch: step times "
         "and tokens/s are slower and noisier than on an idle host; memory is not affected." if shared >= 0.2
         else f"**Load.** Other work used at most {shared:.0%} of the host's cores during any launch: the speeds "
              "are close to an idle host's."),
        _threads_note(rows) if cpu else "",
        "![per-rank memory](sequence_memory.png)\n\n![throughput](sequence_speed.png)",
        "## Environment\n\n" + report.environment_markdown(env),
    ] if block])
    return list(paths.values())


# ---------------------------------------------------------------------------------------------- driver
def point_sets(args: argparse.Namespace, cfg, sp: int, seq_len: int, world: int, raw: str) -> list[str]:
    """The run of one point: only the layout, the length and the batch change; no evaluation or checkpoints
    (they would add their own memory and time)."""
    sets = args.set + [f"parallel.sequence_parallel={sp}", f"data.seq_len={seq_len}", "train.micro_batch_size=1",
                       f"train.global_batch_size={world // sp}", f"train.steps={args.warmup + args.steps + 1}",
                       "eval.interval=0", "checkpoint.interval=0",
                       f"train.output_dir={os.path.join(raw, f'sp{sp}-{seq_len}')}"]
    # The tiny presets are built for 1,024 positions; the default rotary embedding extends to any length.
    mcfg = cfg.model.hf_config
    if mcfg.max_position_embeddings < seq_len:
        sets.append(f"model.overrides.max_position_embeddings={max(args.seq_lens)}")
    if args.peak_tflops:
        sets.append(f"train.peak_tflops={args.peak_tflops}")
    if args.tiled_mlp:
        sets.append(f"train.tiled_mlp={args.tiled_mlp}")
    return sets


def run_sequence_bench(args: argparse.Namespace) -> tuple[list[dict], list[dict], list[dict], str]:
    """Validate every point, then launch them one after the other; returns the rows, the points whose launch
    failed, the ranks' reports of the largest launch (for the environment) and a busy host's banner ("" if none)."""
    check_quiet_host(args.allow_busy)
    raw = os.path.join(args.out, "raw")
    os.makedirs(raw, exist_ok=True)
    cfg = load_run_config(args.config, args.set)
    plans = []
    for sp in args.sp:
        world = count_slots(args.hostfile, args.include, args.exclude) if args.hostfile else sp
        for seq_len in args.seq_lens:
            sets = point_sets(args, cfg, sp, seq_len, world, raw)
            try:  # every point is checked before the first launch: a bad one fails in seconds, not minutes
                load_and_validate(args.config, args.deepspeed_config, sets, world)
            except ConfigError as e:
                raise ConfigError(f"SP={sp}, seq_len {seq_len} on {world} ranks: {e}") from e
            plans.append((sp, seq_len, world, sets))
    # The same threads per rank at every degree, like one device per rank (an SP=1 rank alone on all the cores
    # would also stall in OpenMP's spin-waits whenever other work holds one of them).
    threads = threads_per_rank(max(args.sp))
    rows, failed, ranks, loads = [], [], [], []
    for sp, seq_len, world, sets in plans:
        print(f"SP={sp}, seq_len {seq_len:,}: {world} ranks, {args.warmup} + {args.steps} steps ...", flush=True)
        name = f"sp{sp}-{seq_len}"
        log = os.path.join(raw, f"{name}.log")
        try:
            with HostLoad(own_tasks=world * threads) as load:
                loads.append(load)
                reports = launch(args, world=world, global_batch_sizes=[world // sp], sets=sets,
                                 deepspeed_config=args.deepspeed_config, log=log, threads=threads,
                                 result=os.path.join(raw, f"{name}.result.json"))[0]
        except LaunchError as e:
            # A length that does not fit (the out-of-memory killer ends a rank) must not lose the other points.
            failed.append({"sp": sp, "seq_len": seq_len, "error": str(e).splitlines()[0], "log": log})
            print(f"  failed: {failed[-1]['error']}", file=sys.stderr)
            continue
        rows.append(point_row(sp, reports, None if args.hostfile else load.other_share))
        ranks = reports if len(reports) >= len(ranks) else ranks
    if not rows:
        raise LaunchError("every launch failed: " + "; ".join(f["error"] for f in failed))
    compare_losses(rows)
    return rows, failed, ranks, next((load.banner() for load in loads if load.busy), "")


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of positive integers")
    return values


def memory_size(text: str) -> int:
    """'4GiB' -> bytes (utils.fmt.parse_bytes)."""
    size = parse_bytes(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"--memory {text!r}: a size such as 4GiB, 24GB or 512MiB")
    return size


def _bench(args: argparse.Namespace) -> int:
    rows, failed, ranks, banner = run_sequence_bench(args)
    fits = [longest_fit(mine, args.memory) for mine in _by_sp(rows).values()]
    paths = write_report(rows, failed, fits, args.memory, ranks, args.out, banner)
    print(report.markdown_table(rows, COLUMNS))
    print(f"\nlongest sequence within {human_bytes(args.memory)} per rank:")
    print(report.markdown_table(fits, FIT_COLUMNS))
    print("\n" + ratio_text(rows)[0])
    if failed:
        print("\n" + _failed_note(failed))
    print("wrote " + ", ".join(paths))
    return 3 if failed else 0


def register(subparsers) -> None:
    """Add `sp` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("sp", help="sequence parallelism: per-rank peak memory and tokens/s vs sequence "
                                         "length, and the longest sequence a memory budget fits")
    # Long sequences make each step slow on a CPU; the steps' peak memory is reached in the first one.
    add_launch_args(p, steps=2, warmup=1)
    p.add_argument("--sp", type=_ints, default=[1, 2], help="SP degrees, each on that many ranks (default 1,2)")
    p.add_argument(*spellings("--seq-lens"), type=_ints, default=[1024, 2048, 4096, 8192],
                   help="sequence lengths (default 1024,2048,4096,8192; on CPU tiny-v3 at SP=1 peaks at ~7 GiB for "
                        "8192 and would need ~27 GiB for 16384: its attention stores the seq x seq weights)")
    p.add_argument("--memory", type=memory_size, default=4 * 2**30,
                   help="per-rank memory budget for the longest-sequence summary (default 4GiB)")
    p.add_argument(*spellings("--tiled-mlp"), type=int, default=0, metavar="TOKENS",
                   help="every point with train.tiled_mlp=TOKENS (ALST's tiled MLPs; default 0: untiled)")
    p.add_argument("--out", default="runs/bench/sequence", help="report directory (raw launches under OUT/raw)")
    p.set_defaults(func=_bench)
