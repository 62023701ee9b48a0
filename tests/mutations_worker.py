"""One rank of the mutation checks (tests/test_mutations.py): short training runs under one `deepspeed` launch, one
after the other as in layouts_worker.py (its --layouts; the real engine set-up and training loop), each with the
deliberate bug its name (the last component of its train.output_dir) names applied to the product code while the
run is built and trained, and undone before the next. `control` and `lora-control` run unmutated. Every run whose
model has LoRA adapters also writes their initial values (initial_adapters.pt, by HF name), the reference's start.

The bugs are subtle on purpose: each would pass a reference that shared the toolkit's code path, and each is patched
where it lives (the function or method the product calls), so it reaches the run the way a real bug would."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch
from peft.tuners.lora import LoraLayer

from deepseek_ds.config import load_run_config
from deepseek_ds.data import sampler
from deepseek_ds.models import loss
from deepseek_ds.models.moe import LoadBalancer
from deepseek_ds.training.loop import train
from deepseek_ds.training.main import parse_args
from layouts_worker import run_layouts
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


def _scaled_gradient(value: torch.Tensor, factor: float) -> torch.Tensor:
    """value itself in the forward (bit for bit), factor x its gradient in the backward."""
    return value + (factor - 1.0) * (value - value.detach())


def mutation(name: str, rank: int, global_batch: int):
    """The context manager that applies bug `name` on this rank (a null context for the controls)."""
    if name in ("control", "lora-control"):
        return contextlib.nullcontext()
    if name == "loss-scale":  # the token-weighted loss scaled by 1 + 1e-4 on rank 1 only
        return patched(loss.TokenWeightedLoss, "__call__", lambda call: lambda self, *a: call(self, *a) *
                       (LOSS_SCALE if rank == 1 else 1.0))
    if name == "grad-scale":  # rank 1's gradient contribution x (1 + 1e-4), the loss it reports unchanged
        return patched(loss.TokenWeightedLoss, "__call__", lambda call: lambda self, *a: _scaled_gradient(
            call(self, *a), LOSS_SCALE if rank == 1 else 1.0))
    if name == "token-count":  # rank 0's first micro-batch left out of the global batch's valid-token count
        return patched(loss, "valid_token_counts", lambda count: lambda micro_batches, depth=0, halo=0:
                       count(micro_batches[1:] if rank == 0 else micro_batches, depth, halo))
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


def around(layout: list[str]):
    """The mutation a layout's name (its train.output_dir's last component) names, applied on this rank while the
    run is built (peft reads LoRA's scaling then) and trained."""
    args = parse_args(layout)
    cfg = load_run_config(args.config, args.set)
    return mutation(Path(cfg.train.output_dir).name, int(os.environ["RANK"]), cfg.train.global_batch_size)


def train_one(run) -> None:
    if run.cfg.lora.r and run.rank == 0:  # the adapters' start, for the reference
        os.makedirs(run.cfg.train.output_dir, exist_ok=True)
        torch.save(tensors(run, trainable=True), os.path.join(run.cfg.train.output_dir, "initial_adapters.pt"))
    train(run)


if __name__ == "__main__":
    sys.exit(run_layouts(sys.argv[1:], train_one, around))
