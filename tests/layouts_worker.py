"""One rank of several short training runs (layouts) under one `deepspeed` launch, trained one after the other: one
start-up (~20-40 s here) for all of them. Each layout is train.py's arguments; its run is the real engine set-up
(build_run) and, by default, the real training loop (training.loop.train: metrics.jsonl, the final save) into its
own train.output_dir. Other workers pass their own per-run function (packing_worker.py, moe_worker.py).

Between layouts the engine is destroyed and the process-wide state an engine leaves behind is reset, so that
ZeRO 0-3, pipelines and expert parallelism can follow each other in any order."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Callable

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import groups, safe_get_full_grad, safe_get_full_optimizer_state

from deepseek_ds.bench.comm_counter import counting
from deepseek_ds.config import load_and_validate
from deepseek_ds.training.loop import train
from deepseek_ds.training.main import parse_args
from deepseek_ds.training.run import Run
from deepseek_ds.training.setup import build_run


def build_layout(argv: list[str]) -> Run:
    """The run train.py's arguments `argv` describe, set up as training.main sets it up."""
    args = parse_args(argv)
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, int(os.environ["WORLD_SIZE"]))
    os.makedirs(cfg.train.output_dir, exist_ok=True)
    return build_run(cfg, ds)


def tear_down(run: Run) -> None:
    run.engine.destroy()
    # A pipeline engine leaves its grid as DeepSpeed's global model-parallel unit: an engine built after it would read
    # it as 2-way model parallelism (a pipeline engine sets its own again).
    groups.mpu = None
    # AutoEP keeps its expert and expert-data-parallel groups by name ("ep_size_2"): a later layout with another
    # topology would reuse them (a pipeline's stage-local expert groups, or the world's) and reduce expert
    # gradients over the wrong ranks, or hang.
    for cached in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                   groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        cached.clear()
    # build_run gives DeepSpeed's logger this layout's rank-log handler: the next layout's lines go to its own log.
    for handler in logging.getLogger("deepseek_ds").handlers:
        deepspeed.utils.logger.removeHandler(handler)
        if isinstance(handler, logging.FileHandler):
            handler.close()


def train_recording_first_gradients(run: Run) -> dict:
    """The real training loop, observed: at its first optimizer step, before clipping, each rank saves the full
    gradient of every trainable parameter it holds by HF name (deepspeed.utils.safe_get_full_grad gathers ZeRO's
    partitions) to first_grads.rank<R>.pt in the run's output_dir. The plain engine clips in clip_fp32_gradients
    before its optimizer steps, the ZeRO optimizers inside their step: whichever comes first records."""
    engine, names, taken = run.engine, run.hf_names, []

    def record():
        if taken:
            return
        taken.append(True)
        grads = {names[key]: g.detach().float().cpu().clone() for key, p in engine.module.named_parameters()
                 if p.requires_grad and key in names and (g := safe_get_full_grad(p)) is not None}
        torch.save(grads, os.path.join(run.cfg.train.output_dir, f"first_grads.rank{dist.get_rank()}.pt"))

    def record_moments():
        """indexer.stage sparse (run.clipping): Adam's first moments after step 1, (1 - beta1) x each clipped
        gradient, to first_moments.rank<R>.pt."""
        if not run.clipping or len(taken) > 1:
            return
        taken.append(True)
        if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
            # ZeRO 1/2 links each parameter to its optimizer state after the first group's step, when the later
            # groups (the indexers') have none yet (DeepSpeed 0.19.8): linked again, now that every group has one.
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        moments = {names[key]: m.detach().float().cpu().clone() for key, p in engine.module.named_parameters()
                   if p.requires_grad and key in names
                   and (m := safe_get_full_optimizer_state(p, "exp_avg")) is not None}
        torch.save(moments, os.path.join(run.cfg.train.output_dir, f"first_moments.rank{dist.get_rank()}.pt"))

    for owner, method in ((engine, "clip_fp32_gradients"), (engine.optimizer, "step")):
        original = getattr(owner, method)
        setattr(owner, method, lambda *a, _original=original, **k: (record(), _original(*a, **k), record_moments())[1])
    return train(run)


def run_layouts(argv: list[str], train_one: Callable[[Run], object] = train,
                around: Callable[[list[str]], contextlib.AbstractContextManager] = lambda layout: contextlib.nullcontext()) -> int:
    """argv: train.py's arguments that every layout shares, and --layouts JSON: [[deepspeed_config, [--set values]],
    ...]; each layout is built and trained by `train_one(run)` inside `around(its train.py arguments)`, and torn
    down before the next."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, type=json.loads)
    parser.add_argument("--first-grads", action="store_true", help="record step 1's gradients (see above)")
    parser.add_argument("--count-comm", action="store_true",
                        help="count each layout's communication per step: bench comm's counter, comm.rank<R>.json")
    ours, shared = parser.parse_known_args(argv)
    if ours.first_grads:
        train_one = train_recording_first_gradients
    if ours.count_comm:
        train_one = counting(train_one)
    for ds_config, sets in ours.layouts:
        layout = shared + ["--deepspeed_config", ds_config] + [a for s in sets for a in ("--set", s)]
        with around(layout):
            run = build_layout(layout)
            train_one(run)
        dist.barrier()
        tear_down(run)
        del run
        gc.collect()  # the engine's tensors and hooks go before the next layout builds its own
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_layouts(sys.argv[1:]))
