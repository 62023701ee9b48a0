"""One rank of sequence-parallel runs under one launch (layouts_worker.py): each layout trains with the real loop
(training.loop.train), and rank 0 also writes every parameter's gradient of step 1 (HF names, before clipping and
the optimizer step; deepspeed.utils.safe_get_full_grad, a collective under ZeRO-3) into its train.output_dir.

Every rank also measures its own memory, apart from the loop's memory_gb, into memory_rank<R>.json: per step the
resident set when backward starts (the forward's activations held: a lower bound of the step's peak, from
/proc/self/statm) and the peak resident set (VmHWM) when the optimizer step returns; and before step 2, between
steps, an allocation written and freed that reaches 256 MiB above step 1's peak, with the VmHWM it left (the next
step's peak must not hold it). Sized from step 1's peak, not fixed: what a step adds over the resident set between
steps varies by host (about 130 MiB here), and a fixed spike would be below the step's own peak."""

import json
import os
import sys

import torch
from deepspeed.utils import safe_get_full_grad

from deepseek_ds.models.names import hf_name
from deepseek_ds.models.pipeline import local_layers
from deepseek_ds.training.loop import train
from deepseek_ds.training.run import Run
from layouts_worker import run_layouts

SPIKE_OVER_PEAK = 256 * 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure_memory(run: Run) -> dict:
    """Wraps the engine's backward, step and get_lr (the loop reads the learning rate before each step) to take
    the measurements the module's docstring names; returns the record they fill."""
    engine, record = run.engine, {"steps": [], "spike_hwm": None}
    backward, step, get_lr = engine.backward, engine.step, engine.get_lr
    in_step = []

    def measured_backward(*args, **kwargs):
        in_step.append(rss_bytes())
        return backward(*args, **kwargs)

    def measured_step(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()  # asked before: the step moves to the next micro-step
        out = step(*args, **kwargs)
        if boundary:
            record["steps"].append({"backward_rss": max(in_step), "hwm": hwm_bytes()})
            in_step.clear()
        return out

    def lr_between_steps():
        if len(record["steps"]) == 1 and record["spike_hwm"] is None:
            spike = torch.ones((hwm_bytes() - rss_bytes() + SPIKE_OVER_PEAK) // 4)  # fp32, every page written
            del spike
            record["spike_hwm"] = hwm_bytes()
        return get_lr()

    engine.backward, engine.step, engine.get_lr = measured_backward, measured_step, lr_between_steps
    return record


def train_keeping_first_gradients(run: Run) -> None:
    engine, grads = run.engine, {}
    memory = measure_memory(run)
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
    with open(os.path.join(run.cfg.train.output_dir, f"memory_rank{run.rank}.json"), "w") as f:
        json.dump(memory, f)
    if run.rank == 0:
        torch.save(grads, os.path.join(run.cfg.train.output_dir, "grads_step1.pt"))


if __name__ == "__main__":
    sys.exit(run_layouts(sys.argv[1:], train_keeping_first_gradients))
