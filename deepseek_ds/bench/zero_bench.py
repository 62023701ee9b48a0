"""`deepseek-ds bench zero`: ZeRO stages side by side on the same model, data and world size.

Each stage is one `deepspeed` launch of the worker with the recipe's DeepSpeed JSON, only
`zero_optimization.stage` (and, with --offload, the offload devices) changed; with --optimizers adamw,muon each stage
runs once per optimizer (the JSON's optimizer section replaced by the shipped config's). Per stage it reports the
bytes of parameters, gradients and optimizer states each rank actually holds (measured from the engine, not computed)
next to the ZeRO paper's formula, the optimizer bytes `plan` predicts (AdamW or Muon, DeepSpeed's padding included),
peak memory, median step time, tokens/s, TFLOP/s per device, MFU, and whether the losses of all stages agree.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

from ..config import ConfigError, load_and_validate, load_ds_config, load_run_config
from ..launcher.world import world_size
from ..models.muon import is_muon
from ..utils.cli_args import add_num_gpus, positive_int, spellings
from ..utils.zero_partition import muon_groups, optimizer_state_bytes, partition_numel
from . import report
from .launch import add_launch_args, launch, step_metrics, threads_per_rank
from .load import HostLoad, check_quiet_host
from .report import Column
from .worker import HELD, MODEL_STATES

# ---------------------------------------------------------------------------------------------- the formula
MASTER_AND_ADAM_BYTES = 12  # the paper's K: fp32 master weights + Adam's exp_avg and exp_avg_sq, 4 bytes each
ADAM_ONLY_BYTES = 8         # fp32 at stage 0: the optimizer updates the fp32 parameters, no master copy


def has_master_copy(stage: int, precision: str) -> bool:
    """ZeRO (stage >= 1) always keeps an fp32 master partition, even when training in fp32 (DeepSpeed clones
    it); at stage 0 only mixed precision does."""
    return stage >= 1 or precision != "fp32"


def zero_formula(psi: float, n: int, stage: int, param_bytes: int, master: bool) -> dict[str, float]:
    """Bytes per data-parallel rank from the ZeRO paper (Rajbhandari et al. 2019) with the run's own precision:
    parameters and gradients take `param_bytes` per element each (2 in mixed precision, 4 in fp32), the
    optimizer K = 12 (8 without a master copy). Stage >= 1 divides the optimizer by N, >= 2 the gradients,
    3 the parameters. With param_bytes 2 this is the paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; in fp32
    it is 16Ψ, 8Ψ + 12Ψ/N, 4Ψ + 16Ψ/N, 20Ψ/N."""
    k = MASTER_AND_ADAM_BYTES if master else ADAM_ONLY_BYTES
    return {"params": param_bytes * psi / (n if stage >= 3 else 1),
            "grads": param_bytes * psi / (n if stage >= 2 else 1),
            "optimizer": k * psi / (n if stage >= 1 else 1)}


OPTIMIZER_CONFIGS = {"adamw": "ds_configs/zero1.json", "muon": "ds_configs/zero1_muon.json"}  # --optimizers' sections


def expected_optimizer_bytes(numels: list[int], n: int, stage: int, master: bool) -> int:
    """The formula's optimizer term with DeepSpeed's padding: exact, so the measurement must equal it."""
    return (MASTER_AND_ADAM_BYTES if master else ADAM_ONLY_BYTES) * partition_numel(numels, n, stage)


def expected_rank_optimizer_bytes(report: dict, stage: int, master: bool) -> int:
    """What `plan` predicts for this rank's optimizer state (utils/zero_partition.py): AdamW's padded formula, or with
    DeepSpeed's Muon (ZeRO >= 1) its two groups, the Muon matrices sorted by shape and the rest, from the engine's
    own tags; ZeRO 1/2's Muon momentum differs by rank (the matrices overlapping each slice)."""
    n, numels, muon = report["dp_size"], report["param_numels"], report.get("param_muon")
    if not muon or stage == 0:
        return expected_optimizer_bytes(numels, n, stage, master)
    return sum(optimizer_state_bytes(g, m, n, report["dp_rank"], stage, report["param_element_size"])
               for g, m in muon_groups(numels, report["param_shapes"], muon))


def optimizer_ds_config(base: dict, name: str | None) -> dict:
    """The base DeepSpeed JSON with the optimizer section of OPTIMIZER_CONFIGS[name] (None: the base's own)."""
    if name is None:
        return base
    return {**base, "optimizer": load_ds_config(OPTIMIZER_CONFIGS[name])["optimizer"]}


def stage_ds_config(base: dict, stage: int, offload: bool) -> dict:
    """The base DeepSpeed JSON at another ZeRO stage. Offload settings apply only where DeepSpeed accepts them
    (optimizer: stage >= 1, parameters: stage 3); --offload adds them there."""
    ds = copy.deepcopy(base)
    zero = dict(ds.get("zero_optimization", {}), stage=stage)
    if offload and stage >= 1:
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    if offload and stage == 3:
        zero.setdefault("offload_param", {"device": "cpu"})
    if stage < 1:
        zero.pop("offload_optimizer", None)
    if stage < 3:
        zero.pop("offload_param", None)
    if stage == 3 and is_muon(ds):
        zero["reduce_scatter"] = False  # DeepSpeed refuses Muon with ZeRO-3's reduce-scatter
    ds["zero_optimization"] = zero
    return ds


def offload_label(ds: dict) -> str:
    zero = ds.get("zero_optimization", {})
    parts = [what for what, key in (("optimizer", "offload_optimizer"), ("params", "offload_param"))
             if zero.get(key, {}).get("device", "none") != "none"]
    return "+".join(parts) or "-"


# ---------------------------------------------------------------------------------------------- rows
def rel_diff(losses: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))


def stage_row(stage: int, offload: str, reports: list[dict]) -> dict:
    """One stage's table row from its ranks' reports: measured bytes next to the formula and plan's optimizer
    bytes (the fullest rank's; every rank's must equal its own), speed, losses."""
    r0 = reports[0]
    n, numels = r0["dp_size"], r0["param_numels"]
    psi = sum(numels)
    master = has_master_copy(stage, r0["precision"])
    formula = zero_formula(psi, n, stage, r0["param_element_size"], master)
    held = {k: max(r["held"][k] for r in reports) for k in HELD}  # the fullest rank decides OOM
    expected = {r["rank"]: expected_rank_optimizer_bytes(r, stage, master) for r in reports}
    measured_states = sum(held[k] for k in MODEL_STATES)
    on_accelerator = not r0["device"].startswith("CPU")
    row = {"model": r0["model"], "optimizer": r0["optimizer_type"], "stage": stage, "offload": offload, "ranks": n,
           "tp": r0["tensor_parallel"], "precision": r0["precision"], "psi": psi,
           "params_bytes": held["params"], "grads_bytes": held["grads"], "optimizer_bytes": held["optimizer"],
           "model_states_bytes": measured_states, "buffers_bytes": held["buffers"],
           "offloaded_bytes": held["offloaded"] if on_accelerator else None,
           "formula_params_bytes": formula["params"], "formula_grads_bytes": formula["grads"],
           "formula_optimizer_bytes": formula["optimizer"], "formula_bytes": sum(formula.values()),
           "ratio": measured_states / sum(formula.values()),
           **{f"ratio_{k}": held[k] / formula[k] for k in MODEL_STATES},
           "optimizer_expected_bytes": max(expected.values()),
           "optimizer_exact": all(r["held"]["optimizer"] == expected[r["rank"]] for r in reports),
           "optimizer_device": r0["optimizer_device"],
           "peak_memory_bytes": max(r["peak_memory"] for r in reports),
           "threads": " / ".join(sorted({str(r["threads"]) for r in reports})),
           "losses": [s["loss"] for s in r0["steps"]], "first_loss": r0["steps"][0]["loss"],
           "last_loss": r0["steps"][-1]["loss"]}
    row.update(step_metrics(reports))
    return row


# Relative loss difference still counted as agreement: ZeRO stages only reorder fp32 sums (~1e-7 measured);
# in bf16 each stage rounds its parameters and gradients at different points (~1e-4 after a few steps).
LOSS_RTOL = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-3}


def compare_losses(rows: list[dict], rtol: float | None) -> None:
    """Every stage against the first one run with the same optimizer: same seed, data and model, so only rounding
    may differ. The tolerance defaults to the precision's."""
    rtol = rtol or LOSS_RTOL[rows[0]["precision"]]
    refs: dict[str, list[float]] = {}
    for row in rows:
        ref = refs.setdefault(row["optimizer"], row["losses"])
        row["loss_rel_diff"] = rel_diff(row["losses"], ref)
        row["loss_rtol"] = rtol
        row["losses_agree"] = row["loss_rel_diff"] <= rtol


# ---------------------------------------------------------------------------------------------- report
COLUMNS = [
    Column("stage", "ZeRO"), Column("optimizer", "optimizer"), Column("offload", "offload"),
    Column("params_bytes", "params / rank", "bytes"), Column("grads_bytes", "grads / rank", "bytes"),
    Column("optimizer_bytes", "optimizer / rank", "bytes"), Column("model_states_bytes", "model states", "bytes"),
    Column("formula_bytes", "formula", "bytes"), Column("ratio", "measured / formula", "{:.3f}"),
    Column("optimizer_expected_bytes", "optimizer (plan)", "bytes"),
    Column("optimizer_exact", "optimizer = plan"),
    Column("offloaded_bytes", "of which in host memory", "bytes"),
    Column("buffers_bytes", "other buffers", "bytes"),
    Column("peak_memory_bytes", "peak memory", "bytes"), Column("step_time_s", "step time (s)", "{:.3f}"),
    Column("tokens_per_s_spread", "tokens/s min / median / max"),
    Column("tflops_per_device", "TFLOP/s per device", "{:.4f}"),
    Column("mfu", "MFU", "{:.1%}"), Column("loss_rel_diff", "loss rel. diff", "{:.1e}"),
]
CSV_COLUMNS = [Column(k, k) for k in (
    "stage", "optimizer", "offload", "ranks", "tp", "precision", "psi", "params_bytes", "grads_bytes", "optimizer_bytes",
    "model_states_bytes", "offloaded_bytes", "buffers_bytes", "formula_params_bytes", "formula_grads_bytes",
    "formula_optimizer_bytes",
    "formula_bytes", "ratio", "ratio_params", "ratio_grads", "ratio_optimizer", "optimizer_expected_bytes",
    "optimizer_exact", "optimizer_device", "peak_memory_bytes", "step_time_s", "step_time_min_s", "step_time_max_s",
    "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "tflops_per_device", "threads",
    "mfu", "first_loss", "last_loss", "loss_rel_diff", "loss_rtol", "losses_agree")]


def _label(row: dict, rows: list[dict]) -> str:
    """ZeRO-N, with the optimizer's name when the rows compare several."""
    several = len({r["optimizer"] for r in rows}) > 1
    return f"ZeRO-{row['stage']}" + (f" {row['optimizer']}" if several else "")


def plot_memory(rows: list[dict], path: str) -> None:
    plt = report.pyplot()
    labels = [_label(r, rows) + (" offload" if r["offload"] != "-" else "") for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    bottom = [0.0] * len(rows)
    for key, color in (("params", "#4C72B0"), ("grads", "#DD8452"), ("optimizer", "#55A868")):
        values = [r[f"{key}_bytes"] / 2**20 for r in rows]
        ax.bar(labels, values, bottom=bottom, label=f"{key} (measured)", color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(labels, [r["formula_bytes"] / 2**20 for r in rows], marker="_", s=900, color="black", zorder=3,
               label="ZeRO formula")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Model states per rank, {rows[0]['ranks']} ranks, {rows[0]['precision']} (Ψ = {rows[0]['psi']:,})")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_speed(rows: list[dict], path: str, cpu: bool) -> None:
    plt = report.pyplot()
    labels = [_label(r, rows) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=110)
    ax1.bar(labels, [r["tokens_per_s"] for r in rows], color="#4C72B0")
    ax1.set_title("throughput (tokens/s, all ranks)")
    ax2.bar(labels, [r["peak_memory_bytes"] / 2**30 for r in rows], color="#C44E52")
    ax2.set_title(f"peak {'RSS' if cpu else 'CUDA memory'} per rank (GiB)")
    for ax in (ax1, ax2):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _notes(rows: list[dict], cpu: bool) -> str:
    ref = rows[0]["stage"]
    worst = max(r["loss_rel_diff"] for r in rows)
    agree = "yes" if all(r["losses_agree"] for r in rows) else "**no**"
    memory = ("CUDA `max_memory_allocated` per rank during the steps" if not cpu else
              "the process's peak RSS (on the CPU ZeRO's savings hardly show in RSS: the per-category bytes "
              "above are the measurement that matters)")
    return f"""\
**Losses agree across stages** (max relative difference to ZeRO-{ref} over {len(rows[0]['losses'])} steps,
tolerance {rows[0]['loss_rtol']:g}): {agree} (worst {worst:.1e}).

**Formula.** Bytes per rank from the ZeRO paper (K = 12) with this run's precision: parameters P·Ψ (÷N at
stage 3), gradients P·Ψ (÷N at stage ≥ 2), optimizer K·Ψ (÷N at stage ≥ 1), with P = 2 (bf16/fp16) or 4
(fp32) bytes and K = 12 = fp32 master weights + Adam's two moments. In mixed precision that is the paper's
16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N; in fp32 (what the CPU trains in) it is 16Ψ (K = 8: no master copy at
stage 0), 8Ψ + 12Ψ/N, 4Ψ + 16Ψ/N and 20Ψ/N, because DeepSpeed keeps an fp32 master partition even for fp32
parameters. "optimizer = plan" checks every rank's optimizer bytes against `deepseek-ds plan`'s prediction
("optimizer (plan)": the fullest rank's), exactly: AdamW's K x the partition with DeepSpeed's padding (ZeRO 1/2: the
flat group padded to a multiple of 2N; ZeRO-3: every parameter to a multiple of N); DeepSpeed's Muon keeps the
master partition of two groups (its matrices sorted by shape; the rest, with Adam's moments) and one momentum
buffer for the matrices: at ZeRO-3 partitioned (below AdamW), at ZeRO 1/2 whole for every matrix overlapping the
rank's slice and held twice (each step's momentum is staged in a copy), above AdamW on few ranks.

**How it is measured.** After the timed steps one more step runs with snapshots at the same points for every
stage: around every optimizer-step call (all categories) and, for "other buffers" under ZeRO 1/2, also at the end
of every micro-batch's backward (the hook on the stage's last gradient, before DeepSpeed's reduction epilogue;
ZeRO-3 holds its bucket around the optimizer step too). Each
category is the most the rank held at its snapshots, counting each distinct storage once: parameters (ZeRO 1/2:
the flat buffer they are views of; ZeRO-3: the `ds_tensor` partitions plus the parameters it keeps whole, not
those gathered for a forward or backward), gradients (`.grad`, DeepSpeed's accumulation and partition buffers),
optimizer (fp32 master partitions, Adam's state, Muon's momentum and its staged copy), and "other buffers":
the gradient communication buckets
(`reduce_bucket_size` elements each, two with `overlap_comm`; they do not shrink with the model; ZeRO-2 allocates
its bucket for each backward and frees it at the backward's end, ZeRO 1 and 3 keep theirs) and anything else the
ZeRO optimizer holds. While a backward fills a bucket the gradients are views into it: they count as the
bucket's. The numbers are the fullest rank's. Peak memory is {memory}.

**Reading the ratios.** Stage 1 holds full gradients only while it accumulates them (it reduces at the
accumulation boundary) and stage 2 reduces each micro-batch into its partition, so the two differ only with
gradient accumulation > 1. DeepSpeed's gradient partition (`grads_in_partition`) holds every parameter that
overlaps the rank's partition whole, and ZeRO-3 keeps parameters under `stage3_param_persistence_threshold`
whole on every rank: with a small model both push the measured/formula ratio above 1; with billions of
parameters they vanish. With offload DeepSpeed also keeps an fp32 gradient partition in host memory for the
CPU optimizer step, so gradients exceed the formula; on a GPU "of which in host memory" shows what left the
device."""


def write_report(rows: list[dict], ranks: list[dict], out: str, load: HostLoad,
                 threads: int | None) -> list[str]:
    """`ranks`: every launch's per-rank reports; `load`: the host's load while they ran; `threads`: the torch threads
    per rank every launch was given (None with a hostfile: its hosts' .deepspeed_env decides)."""
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f) for k, f in (("md", "zero.md"), ("csv", "zero.csv"),
                                                  ("memory", "zero_memory.png"), ("speed", "zero_speed.png"))}
    report.write_csv(paths["csv"], rows, CSV_COLUMNS)
    plot_memory(rows, paths["memory"])
    cpu = report.on_cpu(ranks)
    plot_speed(rows, paths["speed"], cpu)
    r = rows[0]
    report.write_markdown(paths["md"], [
        f"# ZeRO stages side by side: {r['model']}", load.banner(),
        f"{r['ranks']} data-parallel ranks" + (f" x {r['tp']} tensor-parallel" if r["tp"] > 1 else "") +
        f", {r['precision']}, Ψ = {r['psi']:,} parameters per rank; each optimizer step "
        f"{r['micro_batch_size']} sequences of {r['seq_len']} tokens x {r['grad_accum']} micro-batches x {r['ranks']} "
        f"ranks. Step time: median of {r['timed_steps']} timed steps after warm-up (tokens/s: of the slowest, "
        "median and fastest step); tokens/s over all ranks; memory per rank." +
        (" " + report.threads_header(threads, r["ranks"] * r["tp"]) if cpu and threads else ""),
        report.markdown_table(rows, COLUMNS),
        _notes(rows, cpu) + (report.threads_note(ranks) if cpu else ""),
        "![model states per rank](zero_memory.png)\n\n![throughput and peak memory](zero_speed.png)",
        "## Environment\n\n" + report.environment_markdown(report.environment(ranks, load)),
    ])
    return list(paths.values())


# ---------------------------------------------------------------------------------------------- driver
def run_zero_bench(args: argparse.Namespace) -> tuple[list[dict], list[dict], HostLoad, int | None]:
    """Validate every stage, then launch them one after the other; returns the rows, every launch's per-rank
    reports (for the environment), the host's load while they ran and the torch threads per rank they were given."""
    check_quiet_host(args.allow_busy)
    world = world_size(args.num_gpus, args.hostfile, args.include, args.exclude)
    raw = os.path.join(args.out, "raw")
    os.makedirs(raw, exist_ok=True)
    cfg = load_run_config(args.config, args.set)
    base = load_ds_config(args.deepspeed_config or cfg.deepspeed_config)
    # Tensor-parallel ranks of a replica share its micro-batches: the data-parallel size is world / tp.
    global_batch = cfg.train.micro_batch_size * max(world // args.tp, 1) * args.grad_accum
    plans = []
    for name in args.optimizers or [None]:
        ds_opt = optimizer_ds_config(base, name)
        # Muon at ZeRO-0 is refused (validate): its default stages start at 1.
        default = [s for s in (0, 1, 2, 3) if s or not is_muon(ds_opt)] if args.tp == 1 else [0, 1, 2]
        for stage in args.stages or default:
            tag = f"{name}-zero{stage}" if name else f"zero{stage}"
            ds_path = os.path.join(raw, f"{tag}.json")
            ds = stage_ds_config(ds_opt, stage, args.offload)
            with open(ds_path, "w") as f:
                json.dump(ds, f, indent=2)
            sets = args.set + ["parallel.pipeline_stages=1", f"parallel.tensor_parallel={args.tp}",
                               f"train.global_batch_size={global_batch}", f"train.steps={args.warmup + args.steps + 1}",
                               f"train.output_dir={os.path.join(raw, tag)}"]
            if args.peak_tflops:
                sets.append(f"train.peak_tflops={args.peak_tflops}")
            # Every stage is checked before the first launch: a bad combination fails in seconds, not minutes.
            try:
                load_and_validate(args.config, ds_path, sets, world)
            except ConfigError as e:
                raise ConfigError(f"{tag} ({ds_path}): {e}") from e
            plans.append((stage, tag, ds_path, sets, offload_label(ds)))
    threads = None if args.hostfile else threads_per_rank(world)  # every stage runs on the same ranks
    rows, ranks = [], []
    with HostLoad(own_tasks=world * (threads or 1)) as load:
        for stage, tag, ds_path, sets, offload in plans:
            print(f"{tag}: {world} ranks, {args.warmup} + {args.steps} steps ...", flush=True)
            reports = launch(args, world=world, global_batch_sizes=[global_batch], sets=sets,
                             deepspeed_config=ds_path, result=os.path.join(raw, f"{tag}.result.json"),
                             log=os.path.join(raw, f"{tag}.log"), threads=threads)[0]
            rows.append(stage_row(stage, offload, reports))
            ranks += reports
    compare_losses(rows, args.loss_rtol)
    return rows, ranks, load, threads


def _stages(text: str) -> list[int]:
    stages = [int(s) for s in text.split(",")]
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"--stages {text!r}: a comma-separated list of 0, 1, 2, 3")
    return stages


def _optimizers(text: str) -> list[str]:
    names = [s.strip().lower() for s in text.split(",")]
    if not names or any(n not in OPTIMIZER_CONFIGS for n in names):
        raise argparse.ArgumentTypeError(f"--optimizers {text!r}: a comma-separated list of {', '.join(OPTIMIZER_CONFIGS)}")
    return names


def _bench(args: argparse.Namespace) -> int:
    rows, ranks, load, threads = run_zero_bench(args)
    paths = write_report(rows, ranks, args.out, load, threads)
    print(report.markdown_table(rows, COLUMNS))
    if load.busy:
        print(f"warning: the host was busy while the benchmark ran ({load.describe()})", file=sys.stderr)
    print("wrote " + ", ".join(paths))
    if not all(r["optimizer_exact"] for r in rows):
        print("warning: measured optimizer bytes differ from plan's (see the CSV)", file=sys.stderr)
    if not all(r["losses_agree"] for r in rows):
        print(f"warning: losses of the stages differ by more than {rows[0]['loss_rtol']:g}", file=sys.stderr)
        return 3
    return 0


def register(subparsers) -> None:
    """Add `zero` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("zero", help="ZeRO stages side by side: measured memory per rank vs the formula, "
                                           "speed, MFU, loss agreement")
    add_launch_args(p)
    p.add_argument("--stages", type=_stages, default=None,
                   help="ZeRO stages to compare (default 0,1,2,3; 1,2,3 with Muon, which refuses ZeRO-0; 0,1,2 with "
                        "--tp > 1: AutoTP has no ZeRO-3 here)")
    p.add_argument("--optimizers", type=_optimizers, default=None,
                   help="every stage once per optimizer (adamw,muon): the JSON's optimizer section replaced by "
                        f"{' / '.join(OPTIMIZER_CONFIGS.values())}'s")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks per replica (parallel.tensor_parallel); the per-rank parameter, "
                        "gradient and optimizer bytes then hold 1/tp of the split matrices")
    p.add_argument("--offload", action="store_true",
                   help="offload the optimizer (stage >= 1) and the parameters (stage 3) to CPU")
    add_num_gpus(p, "--nproc", help="ranks (default: the local GPUs, or 2 without CUDA; with --hostfile the "
                                    "slots it and --include/--exclude select)")
    p.add_argument(*spellings("--grad-accum"), type=int, default=2,
                   help="gradient accumulation steps (>= 2 shows stage 1's full gradients between micro-batches)")
    p.add_argument(*spellings("--loss-rtol"), type=float, default=None,
                   help="relative loss difference still counted as agreement (default 1e-5 in fp32, 1e-3 in bf16/fp16)")
    p.add_argument("--out", default="runs/bench/zero", help="report directory (raw launches under OUT/raw)")
    p.set_defaults(func=_bench)
