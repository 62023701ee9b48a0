"""Entry point of one training rank (started by the `deepspeed` launcher)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import yaml

from ..config import ConfigError, load_ds_config, load_run_config, resolve_ds_config, validate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a DeepSeek-family model with DeepSpeed (run under `deepspeed`).")
    p.add_argument("--config", required=True, help="run YAML, e.g. recipes/tiny-v3.yaml")
    p.add_argument("--deepspeed_config", default=None, help="DeepSpeed JSON (default: the run YAML's deepspeed_config)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a run YAML value")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the launcher
    return p.parse_args(argv)


def load_and_validate(args, world_size: int):
    cfg = load_run_config(args.config, args.set)
    if args.deepspeed_config:
        cfg.deepspeed_config = args.deepspeed_config
    ds_raw = load_ds_config(cfg.deepspeed_config)
    validate(cfg, ds_raw, world_size)
    return cfg, resolve_ds_config(ds_raw, cfg, world_size)


def write_resolved(cfg, ds, world: int) -> None:
    import deepspeed
    import torch
    import transformers

    os.makedirs(cfg.train.output_dir, exist_ok=True)
    doc = {"run": cfg.to_dict(), "deepspeed": ds, "world_size": world,
           "versions": {"python": platform.python_version(), "torch": str(torch.__version__),
                        "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}}
    with open(os.path.join(cfg.train.output_dir, "resolved_config.yaml"), "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)


# How long the other ranks of a host leave local rank 0 to report a failure that every rank hits.
REPORT_GRACE_S = 3.0


def report_failure(message: str) -> None:
    """Every rank fails the same way; one message per host, no tracebacks. The launcher kills a host's other ranks
    as soon as one exits, so local rank 0 reports at once and the others only if it has not ended the job within
    REPORT_GRACE_S (otherwise a faster rank's exit could kill rank 0 before it printed)."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        time.sleep(REPORT_GRACE_S)
    print(f"deepseek-ds: {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg, ds = load_and_validate(args, world)
    except ConfigError as e:
        report_failure(str(e))
        return 2

    from .loop import train
    from .setup import build_run
    import torch.distributed as dist

    os.makedirs(cfg.train.output_dir, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", cfg.train.output_dir)  # wandb writes to ./wandb otherwise
    if rank == 0:
        write_resolved(cfg, ds, world)
    from .nan_policy import NonFiniteLoss

    run = build_run(cfg, ds)
    try:
        train(run)
    except NonFiniteLoss as e:
        report_failure(str(e))
        dist.destroy_process_group()
        return 3
    dist.barrier()
    dist.destroy_process_group()
    return 0
