"""One rank of short training runs on hand-packed sequences under the `deepspeed` launcher, one run per layout in
the same launch: the real engine set-up (build_run) and train_step on micro-batches (input_ids, labels,
position_ids) of reference.packed_global_batch, this data-parallel rank's contiguous share of each global batch.
Rank 0 writes each run's per-step losses into its train.output_dir."""

import argparse
import json
import os
import sys

import torch.distributed as dist

from deepseek_ds.config import load_and_validate
from deepseek_ds.training.loop import train_step
from deepseek_ds.training.main import parse_args
from deepseek_ds.training.schedule import start_lr_schedule
from deepseek_ds.training.setup import build_run
from reference import packed_global_batch


def train_layout(argv: list[str]) -> None:
    args = parse_args(argv)
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, int(os.environ["WORLD_SIZE"]))
    run = build_run(cfg, ds)
    start_lr_schedule(run.engine)  # as the training loop does: the first step is not at lr 0
    t = cfg.train
    share, mbs = t.global_batch_size // run.dp_size, t.micro_batch_size
    losses = []
    for step in range(1, t.steps + 1):
        ids, labels, positions, _ = packed_global_batch(step, t.global_batch_size, cfg.data.seq_len,
                                                        run.model_config.vocab_size, t.seed)
        mine = slice(run.dp_rank * share, (run.dp_rank + 1) * share)
        ids, labels, positions = ids[mine], labels[mine], positions[mine]
        batch = [(ids[i:i + mbs], labels[i:i + mbs], positions[i:i + mbs]) for i in range(0, share, mbs)]
        losses.append(train_step(run, batch))
    if run.rank == 0:
        with open(os.path.join(cfg.train.output_dir, "losses.json"), "w") as f:
            json.dump({"losses": losses, "dp_size": run.dp_size}, f)


def main(argv: list[str]) -> int:
    """argv: train.py's arguments that every layout shares, and --layouts JSON: [[deepspeed_config, [--set values]],
    ...], trained one after the other (one launch's start-up for all of them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, type=json.loads)
    ours, shared = parser.parse_known_args(argv)
    for ds_config, sets in ours.layouts:
        train_layout(shared + ["--deepspeed_config", ds_config] + [a for s in sets for a in ("--set", s)])
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
