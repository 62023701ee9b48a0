"""One rank of short MoE training runs under the `deepspeed` launcher, one run per layout in the same launch
(layouts_worker.py): the real engine set-up (build_run) and the training loop's own step (loop.recorded_step: the
step, its metrics and the router-bias update from the reduced loads) on the run's own batches, then DeepSpeed's own
save_checkpoint. Rank 0 writes the per-step records; every rank writes its own router biases (a checkpoint holds only
data-parallel rank 0's)."""

import json
import os
import sys

import torch

from deepseek_ds.data import micro_batches
from deepseek_ds.models.moe import moe_blocks, router_bias
from deepseek_ds.training.loop import recorded_step, router_stats, step_meter
from deepseek_ds.training.run import Run
from deepseek_ds.training.schedule import start_lr_schedule
from layouts_worker import run_layouts


def train_moe(run: Run) -> None:
    engine, out, cfg = run.engine, run.cfg.train.output_dir, run.cfg
    start_lr_schedule(engine)  # as the training loop does: the first step is not at lr 0
    sampler = run.sampler()  # the run's own order, as the training loop takes it
    batches = micro_batches(run.dataset, sampler)
    meter, routers = step_meter(run), router_stats(run)
    records = [recorded_step(run, batches, sampler, meter, routers, step, engine.get_lr()[0])[0]
               for step in range(1, cfg.train.steps + 1)]
    biases = {name: router_bias(router).detach().cpu().clone() for name, (_, router) in moe_blocks(engine.module).items()}
    torch.save(biases, os.path.join(out, f"biases_rank{run.rank}.pt"))
    engine.save_checkpoint(os.path.join(out, "checkpoint"), tag="last")
    if run.rank == 0:
        with open(os.path.join(out, "records.json"), "w") as f:
            json.dump({"records": records, "dp_size": run.dp_size}, f)


if __name__ == "__main__":  # layouts_worker.py's --layouts, each run trained by train_moe
    sys.exit(run_layouts(sys.argv[1:], train_moe))
