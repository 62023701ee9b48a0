"""Entry point of one training rank (started by the `deepspeed` launcher)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch.distributed as dist

from .. import config
from ..checkpoint.existing import check_existing_checkpoint
from ..config import write_resolved
from ..launcher.lifeline import Lifeline
from ..utils.cli_args import add_run_args
from ..utils.errors import UserError, format_user_error
from ..utils.jit_lock import announce, check_jit_locks
from .loop import train
from .nan_policy import NonFiniteLoss
from .process import log_failure_to_file
from .setup import build_run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a DeepSeek-family model with DeepSpeed (run under `deepspeed`).")
    add_run_args(p)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the launcher
    return p.parse_args(argv)


# How long the other ranks of a host leave local rank 0 to report a failure that every rank hits.
REPORT_GRACE_S = 3.0


def report_failure(line: str) -> None:
    """Every rank fails the same way; one line per host, no tracebacks. The launcher kills a host's other ranks
    as soon as one exits, so local rank 0 reports at once and the others only if it has not ended the job within
    REPORT_GRACE_S (otherwise a faster rank's exit could kill rank 0 before it printed)."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        time.sleep(REPORT_GRACE_S)
    print(line, file=sys.stderr, flush=True)


def say_and_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    log_failure_to_file(line)


def main(argv=None) -> int:
    # Armed first: a rank still starting up also ends when `deepseek-ds train` or its launch.py is gone.
    with Lifeline(say=say_and_log):
        return _main(argv)


def _main(argv) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg, ds = config.load_and_validate(args.config, args.deepspeed_config, args.set, world)
        check_existing_checkpoint(cfg)  # a foreign checkpoint is refused before any engine is built
        check_jit_locks(say=None if int(os.environ.get("LOCAL_RANK", 0)) else announce)  # before any op loads
    except UserError as e:
        report_failure(format_user_error(e))
        return 2

    os.makedirs(cfg.train.output_dir, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", cfg.train.output_dir)  # wandb writes to ./wandb otherwise
    # resolved_config.yaml is written once the run (and its resume, if any) is accepted: a refused run leaves the
    # record of the run already in output_dir alone.
    accepted = (lambda: write_resolved(cfg, ds, world)) if rank == 0 else None
    status = 0
    try:
        train(build_run(cfg, ds), on_accepted=accepted)
    except (UserError, NonFiniteLoss) as e:  # a dataset or checkpoint that does not fit the run, or a NaN stop:
        line = format_user_error(e) if isinstance(e, UserError) else f"deepseek-ds: {e}"  # every rank finds the same
        log_failure_to_file(line)
        report_failure(line)
        status = 2 if isinstance(e, UserError) else 3
    except BaseException as e:  # a bug, or a signal: the traceback goes to the console as usual and to the rank's log
        log_failure_to_file(f"this rank failed:\n{traceback.format_exc()}")
        if not (isinstance(e, SystemExit) and not e.code):
            raise
        # Something called sys.exit(0) mid-training: status 0 would tell the launcher this rank is done, and it would
        # leave the others waiting on it (for train.dist_timeout_s on NCCL) instead of ending the job.
        print(f"deepseek-ds: rank {rank} was made to exit with status 0 before the end of training (traceback in its "
              "log): exiting 1", file=sys.stderr, flush=True)
        status = 1
    else:
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return status


if __name__ == "__main__":  # `deepspeed --module deepseek_ds.training.main` (deepseek-ds train)
    sys.exit(main())
