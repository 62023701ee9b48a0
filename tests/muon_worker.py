"""One rank of the Muon layouts (test_muon.py) under one `deepspeed` launch (layouts_worker.py): before the real
training loop, each rank writes the `use_muon` tag that DeepSpeed's Muon reads from every parameter of its engine
(by the engine's own parameter names) to muon_tags.rank<R>.json in the run's train.output_dir."""

import json
import os
import sys

import torch.distributed as dist

from deepseek_ds.training.loop import train
from deepseek_ds.training.setup import Run
from layouts_worker import run_layouts


def record_tags_and_train(run: Run) -> None:
    tags = {name: bool(getattr(p, "use_muon", False)) for name, p in run.engine.module.named_parameters()}
    with open(os.path.join(run.cfg.train.output_dir, f"muon_tags.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(tags, f)
    train(run)


if __name__ == "__main__":
    sys.exit(run_layouts(sys.argv[1:], record_tags_and_train))
