"""One rank of the Muon layouts (test_muon.py) under one `deepspeed` launch (layouts_worker.py): before the real
training loop, each rank writes the `use_muon` tag that DeepSpeed's Muon reads from every parameter of its engine
(by the engine's own parameter names) to muon_tags.rank<R>.json in the run's train.output_dir; during it, bench zero's
probe (bench/worker.py) snapshots the bytes of parameters, gradients and optimizer state the rank holds around the
last optimizer step's calls, as bench zero measures its last step, and their peaks go to held.rank<R>.json (what
`plan` must predict to the byte)."""

import json
import os
import sys

import torch.distributed as dist

from deepseek_ds.bench.worker import HELD, PhaseClock, StateProbe, instrument
from deepseek_ds.training.loop import train
from deepseek_ds.training.setup import Run
from layouts_worker import run_layouts


class LastStepProbe(StateProbe):
    """Armed for the run's last optimizer step only (snapshots cost a walk of the optimizer each)."""

    def __init__(self, engine, steps: int):
        super().__init__(engine)
        self.steps = steps

    def snapshot(self, categories=HELD) -> None:
        self.armed = self.engine.global_steps >= self.steps - 1
        super().snapshot(categories)


def record_tags_and_train(run: Run) -> None:
    tags = {name: bool(getattr(p, "use_muon", False)) for name, p in run.engine.module.named_parameters()}
    out = run.cfg.train.output_dir
    with open(os.path.join(out, f"muon_tags.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(tags, f)
    probe = LastStepProbe(run.engine, run.cfg.train.steps)
    hooks = instrument(run.engine, PhaseClock(run.engine.device), probe)
    train(run)
    for hook in hooks:
        hook.remove()
    with open(os.path.join(out, f"held.rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"dp_rank": run.dp_rank, "stage_id": int(getattr(run.engine, "stage_id", 0)), "held": probe.peak}, f)


if __name__ == "__main__":
    sys.exit(run_layouts(sys.argv[1:], record_tags_and_train))
