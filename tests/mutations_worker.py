"""One rank of the mutation checks (tests/test_mutations.py): short training runs under one `deepspeed` launch, one
after the other as in layouts_worker.py (its --layouts; the real engine set-up and training loop), each with the
deliberate bug its name (the last component of its train.output_dir) names applied to the product code while the
run is built and trained, and undone before the next. `control` and `lora-control` run unmutated. Every run whose
model has LoRA adapters also writes their initial values (initial_adapters.pt, by HF name), the reference's start.

The bugs are subtle on purpose: each would pass a reference that shared the toolkit's code path, and each is patched
where it lives (the function or method the product calls), so it reaches the run the way a real bug would."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from peft.tuners.lora import LoraLayer

from deepseek_ds.config import load_run_config
from deepseek_ds.data import sampler
from deepseek_ds.models import loss
from deepseek_ds.models.moe import LoadBalancer
from deepseek_ds.training.loop import train
from deepseek_ds.training.main import parse_args
from layouts_worker import build_layout, tear_down
from lora_worker import tensors

LOSS_SCALE = 1 + 1e-4


@contextlib.contextmanager
def patched(owner, name: str, make: Callable) -> Iterator[None]:
    """owner.name replaced by make(original) inside the block; with a module owner, also every module that imported
    the function by name (`from .loss import valid_token_counts`), so that every caller gets the mutation."""
    original = getattr(owner, name)
    holders = [owner] if not isinstance(owner, ModuleType) else \
        [m for m in list(sys.modules.values()) if isinstance(m, ModuleType) and vars(m).get(name) is original]
    for holder in holders:
        setattr(holder, name, make(original))
    try:
        yield
    finally:
        for holder in holders:
            setattr(holder, name, original)


def mutation(name: str, rank: int, global_batch: int):
    """The context manager that applies bug `name` on this rank (a null context for the controls)."""
    if name in ("control", "lora-control"):
        return contextlib.nullcontext()
    if name == "loss-scale":  # the token-weighted loss scaled by 1 + 1e-4 on rank 1 only
        return patched(loss.TokenWeightedLoss, "__call__", lambda call: lambda self, *a: call(self, *a) *
                       (LOSS_SCALE if rank == 1 else 1.0))
    if name == "token-count":  # rank 0's first micro-batch left out of the global batch's valid-token count
        return patched(loss, "valid_token_counts", lambda count: lambda micro_batches, depth=0:
                       count(micro_batches[1:] if rank == 0 else micro_batches, depth))
    if name == "sample-swap":  # the first sample of the first and of the second global batch trade places

        def swap(order_of):
            def order(num_samples, seed, epoch, shuffle):
                out = order_of(num_samples, seed, epoch, shuffle).copy()
                out[[0, global_batch]] = out[[global_batch, 0]]
                return out
            return order
        return patched(sampler, "epoch_order", swap)
    if name == "bias-sign":  # b_i -= gamma * sign(mean load - load_i): the same step, the other way
        return patched(LoadBalancer, "_update_bias", lambda update: lambda self, load, skipped:
                       update(self, 2 * load.mean(1, keepdim=True) - load, skipped))
    if name == "lora-scaling":  # peft's adapter scaling alpha / r replaced by alpha

        def scaled(update_layer):
            def update(self, adapter_name, *args, **kwargs):
                update_layer(self, adapter_name, *args, **kwargs)
                self.scaling[adapter_name] = self.lora_alpha[adapter_name]
            return update
        return patched(LoraLayer, "update_layer", scaled)
    raise ValueError(f"unknown mutation {name!r}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, type=json.loads)
    ours, shared = parser.parse_known_args(argv)
    rank = int(os.environ["RANK"])
    for ds_config, sets in ours.layouts:
        layout = shared + ["--deepspeed_config", ds_config] + [a for s in sets for a in ("--set", s)]
        args = parse_args(layout)
        cfg = load_run_config(args.config, args.set)
        out = cfg.train.output_dir
        with mutation(Path(out).name, rank, cfg.train.global_batch_size):
            run = build_layout(layout)
            if cfg.lora.r and rank == 0:
                os.makedirs(out, exist_ok=True)
                torch.save(tensors(run, trainable=True), os.path.join(out, "initial_adapters.pt"))
            train(run)
        dist.barrier()
        tear_down(run)
        del run
        gc.collect()  # the engine's tensors and hooks go before the next layout builds its own
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
