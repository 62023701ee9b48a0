"""One rank of short training runs on hand-packed sequences under the `deepspeed` launcher, one run per layout in
the same launch (layouts_worker.py): the real engine set-up (build_run) and train_step on micro-batches (input_ids,
labels, position_ids) of reference.packed_global_batch, this data-parallel rank's contiguous share of each global
batch. Rank 0 writes each run's per-step losses into its train.output_dir."""

import json
import os
import sys

from deepseek_ds.training.loop import train_step
from deepseek_ds.training.run import Run
from deepseek_ds.training.schedule import start_lr_schedule
from layouts_worker import run_layouts
from reference import packed_global_batch


def train_packed(run: Run) -> None:
    start_lr_schedule(run.engine)  # as the training loop does: the first step is not at lr 0
    cfg = run.cfg
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
        with open(os.path.join(t.output_dir, "losses.json"), "w") as f:
            json.dump({"losses": losses, "dp_size": run.dp_size}, f)


if __name__ == "__main__":  # layouts_worker.py's --layouts, each run trained by train_packed
    sys.exit(run_layouts(sys.argv[1:], train_packed))
