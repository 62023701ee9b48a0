"""`deepseek-ds bench lora`: the memory story of LoRA, full fine-tuning versus LoRA of the same model, data, DeepSpeed
JSON and world size. Each is one `deepspeed` launch of the benchmark worker (bench/worker.py); per rank it reports
the trainable parameters and the bytes of trainable parameters, gradients and optimizer state the engine holds
(measured, not computed), and the speed.
"""

from __future__ import annotations

import argparse
import json
import os

from ..config import ConfigError, load_and_validate, load_run_config
from ..launcher.world import world_size
from ..utils.cli_args import add_num_gpus, spellings
from . import report
from .launch import add_launch_args, launch, step_metrics, threads_per_rank
from .load import HostLoad, check_quiet_host
from .report import Column

COLUMNS = [
    Column("run", "run"), Column("trainable", "trainable params / rank", "{:,d}"),
    Column("trainable_share", "share", "{:.1%}"), Column("params", "params (MB/rank)", "{:.2f}"),
    Column("grads", "grads (MB/rank)", "{:.3f}"), Column("optimizer", "optimizer (MB/rank)", "{:.3f}"),
    Column("optimizer_per_trainable", "optimizer B / trainable param x N", "{:.1f}"),
    Column("tokens_per_s", "tokens/s", "{:,.0f}"), Column("step_time_s", "step (s)", "{:.3f}"),
]
MB = 2**20


def lora_row(name: str, reports: list[dict], total_params: int | None) -> dict:
    """One run's row: the largest per-rank value of each measured category (the rank that limits the run)."""
    trainable = max(sum(r["param_numels"]) for r in reports)
    held = {k: max(r["held"][k] for r in reports) for k in ("params", "grads", "optimizer")}
    return {"run": name, "trainable": trainable,
            "trainable_share": trainable / total_params if total_params else None,
            **{k: v / MB for k, v in held.items()},
            "optimizer_per_trainable": held["optimizer"] / trainable * reports[0]["dp_size"],
            **step_metrics(reports)}


def run_lora_bench(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    world = world_size(args.num_gpus, args.hostfile, args.include, args.exclude)
    raw = os.path.join(args.out, "raw")
    os.makedirs(raw, exist_ok=True)
    cfg = load_run_config(args.config, args.set)
    r = args.r or cfg.lora.r
    if not r:
        raise ConfigError("bench lora needs a rank: give --r N or a recipe with lora.r > 0 (e.g. "
                          "recipes/lora-tiny-v3.yaml)")
    global_batch = cfg.train.micro_batch_size * cfg.data_parallel_size(world) * args.grad_accum
    common = args.set + [f"train.global_batch_size={global_batch}", f"train.steps={args.warmup + args.steps + 1}",
                         "eval.interval=0", "eval.task=null"]
    plans = [("full fine-tuning", ["lora.r=0"]), (f"LoRA r={r}", [f"lora.r={r}"])]
    for name, extra in plans:  # both checked before the first launch
        try:
            load_and_validate(args.config, args.deepspeed_config, common + extra, world)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}") from e
    threads = None if args.hostfile else threads_per_rank(world)
    rows, reports = [], []
    for i, (name, extra) in enumerate(plans):
        print(f"{name}: {world} ranks, {args.warmup} + {args.steps} steps ...", flush=True)
        sets = common + extra + [f"train.output_dir={os.path.join(raw, f'run{i}')}"]
        reports = launch(args, world=world, global_batch_sizes=[global_batch], sets=sets,
                         deepspeed_config=args.deepspeed_config, result=os.path.join(raw, f"run{i}.result.json"),
                         log=os.path.join(raw, f"run{i}.log"), threads=threads)[0]
        rows.append(lora_row(name, reports, rows[0]["trainable"] if rows else None))
    rows[0]["trainable_share"] = 1.0
    return rows, reports


def _bench(args: argparse.Namespace) -> int:
    check_quiet_host(args.allow_busy)
    with HostLoad() as load:
        rows, ranks = run_lora_bench(args)
    table = report.markdown_table(rows, COLUMNS)
    md, data = os.path.join(args.out, "lora.md"), os.path.join(args.out, "lora.json")
    report.write_markdown(md, [
        "# Full fine-tuning vs LoRA: model states per rank", load.banner(),
        f"{ranks[0]['world']} ranks, ZeRO-{ranks[0]['zero_stage']}, {ranks[0]['precision']}; measured from the engine "
        "(bench/worker.held_bytes): params are all the model's (the frozen base included), grads and optimizer "
        "state only the trainable parameters'.", table,
        "## Environment\n\n" + report.environment_markdown(report.environment(ranks, load))])
    with open(data, "w") as f:
        json.dump(rows, f, indent=2)
    print(table)
    print(f"wrote {md}, {data}")
    return 0


def register(subparsers) -> None:
    """Add `lora` to the `deepseek-ds bench` sub-command group."""
    p = subparsers.add_parser("lora", help="full fine-tuning vs LoRA of the same model: trainable parameters, "
                                           "gradient and optimizer bytes per rank (measured), speed")
    add_launch_args(p)
    add_num_gpus(p)
    p.add_argument("--r", type=int, default=None, help="LoRA rank (default: the recipe's lora.r)")
    p.add_argument(*spellings("--grad-accum"), type=int, default=1, help="micro-batches per step and rank (default 1)")
    p.add_argument("--out", default="runs/bench/lora", help="report directory (raw launches under OUT/raw)")
    p.set_defaults(func=_bench)
