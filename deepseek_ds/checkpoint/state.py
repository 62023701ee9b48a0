"""What DeepSpeed's checkpoint files do not hold: every rank's RNG states, the persistent buffers (the MoE
routers' e_score_correction_bias) by HF name, which a universal checkpoint (parameters only) lacks, the LoRA
adapters of each expert-parallel rank's experts (parallel/expert_lora.py), and the CPU Adam kernel's running beta
powers (rebuilt by replaying the steps)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.adam.fused_adam import multi_tensor_applier
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from ..models.pipeline import local_layers
from ..parallel import expert_lora
from ..utils.private_api import (
    expert_data_parallel_rank,
    expert_parallel_rank,
    fused_adam_overflow_buffer,
    non_persistent_buffer_names,
)
from .format import CheckpointError
from .run import TrainingRun


# ----------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """This rank's RNG states, as saved in rng_path."""
    name, keys, pos, gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             # as tensors and numbers: the weights-only unpickler that reads it back rejects numpy arrays
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(gauss), float(cached))}
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        state["accelerator"] = acc.get_rng_state()
    return state


def rng_path(tag_dir: str, rank: int) -> str:
    return os.path.join(tag_dir, "rng", f"rank_{rank:05d}.pt")


def restore_rng(tag_dir: str, rank: int) -> bool:
    """Restore this rank's RNG states; False when the checkpoint has none for it (its layout had fewer ranks)."""
    path = rng_path(tag_dir, rank)
    if not os.path.isfile(path):
        return False
    state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    name, keys, pos, gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, gauss, cached))
    if "accelerator" in state and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(state["accelerator"])
    return True


# ----------------------------------------------------------------------------------------------- buffers
def _local_buffers(run: TrainingRun) -> dict[str, torch.Tensor]:
    """This rank's persistent buffers by DeepSpeed module name (walked directly: state_dict() would also touch
    ZeRO-3's partitioned parameters)."""
    out = {}
    for prefix, mod in run.engine.module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in non_persistent_buffer_names(mod):
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def buffers_file(tag_dir: str, run: TrainingRun) -> tuple[str, Callable[[], bytes]]:
    """This pipeline stage's persistent buffers: (the file's path, its bytes when called)."""
    names = run.hf_names
    local = {names[k]: v for k, v in _local_buffers(run).items() if k in names}
    stage = run.engine.stage_id if run.pipeline else 0
    return (os.path.join(tag_dir, "buffers", f"stage_{stage:02d}.safetensors"),
            lambda: safetensors_bytes({k: v.detach().cpu().contiguous() for k, v in local.items()}))


def read_buffers(tag_dir: str) -> dict[str, torch.Tensor]:
    """All persistent buffers of a checkpoint by HF name (safetensors: no pickle involved)."""
    out = {}
    folder = os.path.join(tag_dir, "buffers")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        out.update(load_file(os.path.join(folder, name)))
    return out


def restore_buffers(run: TrainingRun, tag_dir: str) -> None:
    names = run.hf_names
    saved = read_buffers(tag_dir)
    with torch.no_grad():
        for key, buf in _local_buffers(run).items():
            hf = names.get(key)
            if hf is None:
                continue
            if hf not in saved:
                raise CheckpointError(f"{tag_dir}/buffers has no {hf}: the checkpoint is incomplete; resume from "
                                      "an earlier step directory")
            buf.copy_(saved[hf])


# ----------------------------------------------------------------------------------------------- expert adapters
EXPERT_ADAPTERS = "expert_adapters"


def expert_adapters(tag_dir: str, run: TrainingRun) -> tuple[dict, str] | None:
    """Every rank calls this (the fp32 rows are gathered within each expert-data-parallel group); the first rank of
    each group gets its expert-parallel rank's (rows, file path) to save; None elsewhere or without adapted AutoEP
    experts."""
    rows = expert_lora.adapter_rows(local_layers(run.engine.module))
    group = _ep_group_name(run)
    if not rows or expert_data_parallel_rank(group) != 0:
        return None
    return rows, _expert_adapters_file(tag_dir, run)


def restore_expert_adapters(run: TrainingRun, tag_dir: str) -> None:
    layers = local_layers(run.engine.module)
    if not any(isinstance(m, expert_lora.LoraGroupedExperts) for layer in layers for m in layer.modules()):
        return
    path = _expert_adapters_file(tag_dir, run)
    if not os.path.isfile(path):
        raise CheckpointError(f"{tag_dir} has no {os.path.relpath(path, tag_dir)}: the checkpoint is incomplete; "
                              "resume from an earlier step directory")
    expert_lora.restore_rows(layers, torch.load(path, weights_only=True))


def read_expert_adapters(tag_dir: str) -> dict[str, torch.Tensor]:
    """peft's tensors of every expert's adapters in a LoRA checkpoint of an expert-parallel run, by HF name."""
    folder = os.path.join(tag_dir, EXPERT_ADAPTERS)
    if not os.path.isdir(folder):
        return {}
    return expert_lora.peft_tensors([torch.load(os.path.join(folder, f), weights_only=True)
                                     for f in sorted(os.listdir(folder))])


def _expert_adapters_file(tag_dir: str, run: TrainingRun) -> str:
    """This pipeline stage's and expert-parallel rank's file (every layer's names are unique across stages)."""
    stage = f"stage_{run.engine.stage_id:02d}_" if run.pipeline else ""
    ep_rank = expert_parallel_rank(_ep_group_name(run))
    return os.path.join(tag_dir, EXPERT_ADAPTERS, f"{stage}ep_rank_{ep_rank:03d}.pt")


def _ep_group_name(run: TrainingRun) -> str:
    return f"ep_size_{run.cfg.parallel.expert_parallel}"  # AutoEPMoELayer's name of its groups


# ----------------------------------------------------------------------------------------------- CPU Adam kernel
def replay_cpu_adam_steps(opt: torch.optim.Optimizer) -> None:
    """DeepSpeed's CPU Adam kernel (FusedAdam on the CPU accelerator; DeepSpeedCPUAdam, ZeRO-Offload's optimizer on
    any machine) keeps beta1^t and beta2^t as float32 running products, which no checkpoint holds: a fresh run
    multiplies them once per step, a resumed one recomputes them with pow(), and the two differ in the last bit
    from 0.95^6 on, so every update after such a resume was off by an ulp. Replaying the optimizer's steps on a
    one-element tensor, in the order step() makes its calls, rebuilds the very products a straight run has.
    opt: the engine's basic optimizer (inside any ZeRO or fp16 wrapper), its state loaded."""
    kernel = _cpu_adam_kernel(opt)
    if kernel is None:
        return
    steps = [_group_step(opt, group) for group in opt.param_groups]
    scratch = [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq: only the kernel's state matters
    for step in range(1, max(steps, default=0) + 1):
        for group, done in zip(opt.param_groups, steps):
            if step <= done:
                kernel(group, step, *scratch)


def _cpu_adam_kernel(opt):
    """A call of `opt`'s kernel on (group, step, param, grad, exp_avg, exp_avg_sq); None when `opt` does not use
    the CPU kernel (CUDA's FusedAdam computes the powers afresh each step)."""
    if isinstance(opt, DeepSpeedCPUAdam):
        return lambda g, step, p, grad, m, v: opt.ds_opt_adam.adam_update(
            opt.opt_id, step, g["lr"], *g["betas"], g["eps"], g["weight_decay"], g["bias_correction"], p, grad, m, v)
    if isinstance(opt, FusedAdam) and get_accelerator().device_name() == "cpu":
        return lambda g, step, p, grad, m, v: multi_tensor_applier(
            opt.multi_tensor_adam, fused_adam_overflow_buffer(opt), [[grad], [p], [m], [v]], g["lr"], *g["betas"],
            g["eps"], step, opt.adam_w_mode, int(g["bias_correction"]), g["weight_decay"])
    return None


def _group_step(opt, group: dict) -> int:
    """The optimizer steps a param group has taken (its parameters' `step` state; 0 before the first)."""
    for p in group["params"]:
        step = opt.state.get(p, {}).get("step")
        if step is not None:
            return int(step)
    return 0
