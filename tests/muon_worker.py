"""One rank of the Muon layouts (test_muon.py) under one `deepspeed` launch (layouts_worker.py): before the real
training loop, each rank writes the `use_muon` tag that DeepSpeed's Muon reads from every parameter of its engine
(by the engine's own parameter names) to muon_tags.rank<R>.json in the run's train.output_dir; during it, bench zero's
probe (bench/worker.py) snapshots the bytes of parameters, gradients and optimizer state the rank holds around the
last optimizer step's calls, as bench zero measures its last step, and their peaks go to held.rank<R>.json (what
`plan` must predict to the byte).

Every rank runs one torch thread (OMP_NUM_THREADS=1, which the training set-up leaves alone), whatever the rank
count: test_muon.py runs its 1-rank launch beside its 2-rank one, three ranks on this machine's two cores, where a
rank given both cores (the set-up's share for a launch of 1 rank) spins its OpenMP threads against the others and ran
its steps many times slower. Threads change no result a test compares but by rounding (the tests compare 1 rank and 2
ranks within 1e-5, and bit for bit only runs of one launch).

--after JSON {train.output_dir: path}: the layout with that output directory starts once the file at `path` exists
and reads "ok" (test_muon.py moves it there when the 1-rank launch, whose checkpoints the layout resumes, has ended), and
fails if it reads anything else."""

import argparse
import contextlib
import json
import os
import sys
import time

import torch
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


@contextlib.contextmanager
def waiting_for(after: dict[str, str], layout: list[str]):
    out = next((a.split("=", 1)[1] for a in layout if a.startswith("train.output_dir=")), None)
    if out in after:
        path = after[out]
        while not os.path.exists(path):
            time.sleep(0.2)
        with open(path) as f:
            if f.read() != "ok":
                raise RuntimeError(f"{out} resumes a checkpoint of a launch that failed ({path})")
    yield


if __name__ == "__main__":
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--after", type=json.loads, default={})
    ours, rest = parser.parse_known_args(sys.argv[1:])
    sys.exit(run_layouts(rest, record_tags_and_train, around=lambda layout: waiting_for(ours.after, layout)))
