"""One rank of sequence-parallel runs under one launch (layouts_worker.py): each layout trains with the real loop
(training.loop.train), and rank 0 also writes every parameter's gradient of step 1 (HF names, before clipping and
the optimizer step; deepspeed.utils.safe_get_full_grad, a collective under ZeRO-3) into its train.output_dir."""

import os
import sys

import torch
from deepspeed.utils import safe_get_full_grad

from deepseek_ds.models.names import hf_name
from deepseek_ds.models.pipeline import local_layers
from deepseek_ds.training.loop import train
from deepseek_ds.training.setup import Run
from layouts_worker import run_layouts


def train_keeping_first_gradients(run: Run) -> None:
    engine, grads = run.engine, {}
    step = engine.step

    def keep_then_step(*args, **kwargs):  # the loop's own engine.step, after reading the gradients once
        if not grads and engine.is_gradient_accumulation_boundary():
            for layer in local_layers(engine.module):
                for key, param in layer.named_parameters():
                    grad = safe_get_full_grad(param)
                    if grad is not None and hf_name(layer, key):
                        grads[hf_name(layer, key)] = grad.detach().float().cpu().clone()
        return step(*args, **kwargs)

    engine.step = keep_then_step
    train(run)
    if run.rank == 0:
        torch.save(grads, os.path.join(run.cfg.train.output_dir, "grads_step1.pt"))


if __name__ == "__main__":
    sys.exit(run_layouts(sys.argv[1:], train_keeping_first_gradients))
