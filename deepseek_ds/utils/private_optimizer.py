"""The seam's third module (utils/private_api.py holds the first, and the table of every private name the three use):
the ZeRO optimizers' gradient norm and clipping, and where DeepSpeed's Muon runs in their step."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from deepspeed.runtime.utils import clip_grad_norm_, combine_grad_norm_groups
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .private_api import attribute_replaced

_MUON_UPDATE = original_muon.muon_update  # DeepSpeed's own, whatever replaces it in the module for a call


# ------------------------------------------------------------------------------------------ the gradient norm
def keep_fp32_clip_norm(engine) -> None:
    """Make the engine keep the norm its fp32 gradient clipping computes (ZeRO-0 without bf16/fp16: DeepSpeed's
    clip_fp32_gradients drops it, so get_global_grad_norm() said None there, and the step line had no norm). The
    same call as DeepSpeed's (its clip_grad_norm_ with the engine's clip and mpu), its result kept."""
    def clip_fp32_gradients() -> None:
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                   max_norm=engine.gradient_clipping(), mpu=engine.mpu)
    engine.clip_fp32_gradients = clip_fp32_gradients


def clip_by_group_norms(optimizer, norm_for: Callable[[list, int], torch.Tensor]) -> list[list[torch.nn.Parameter]]:
    """ZeRO 1-3's optimizer clips group i's gradients by the norm `norm_for(norms, i)` gives instead of the norm of all
    its groups together (DeepSpeed combines every group's norm into one; no option does otherwise). norms: the step's
    norm of each group as DeepSpeed computed it for that one (reduced over the ranks, loss-scaled); its groups are
    ZeRO 1/2's parameter groups, ZeRO-3's sub-groups, called in order from 0. Returns each group's parameters. The
    reported global norm stays DeepSpeed's, of all groups."""
    norms: list = []
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        norm_groups, clip = optimizer._get_norm_groups, optimizer.unscale_and_clip_grads

        def recorded() -> list:
            norms[:] = norm_groups()
            return list(norms)
        optimizer._get_norm_groups = recorded
        optimizer.unscale_and_clip_grads = lambda sub_group, total_norm: clip(sub_group, norm_for(norms, sub_group))
        return optimizer.fp16_groups
    direct, average, clip = (optimizer.get_grad_norm_direct, optimizer._average_expert_grad_norms,
                             optimizer.unscale_and_clip_grads)
    norms += [None] * len(optimizer.bit16_groups)

    def recorded_direct(gradients, params, norm_type=2):
        norm = direct(gradients, params, norm_type)
        for i, own in enumerate(optimizer.params_in_partition):
            if own is params:
                norms[i] = norm
        return norm

    def recorded_average(norm_groups: list) -> None:  # expert groups' norms, as DeepSpeed combines them
        average(norm_groups)
        norms[:] = norm_groups

    def clipped(grad_groups_flat: list, total_norm):
        group = next(i for i, fp32 in enumerate(optimizer.single_partition_of_fp32_groups)
                     if fp32.grad is grad_groups_flat[0])
        return clip(grad_groups_flat, norm_for(norms, group))
    optimizer.get_grad_norm_direct = recorded_direct
    optimizer._average_expert_grad_norms = recorded_average
    optimizer.unscale_and_clip_grads = clipped
    return optimizer.bit16_groups


# ------------------------------------------------------------------------------------------ Muon's update
@dataclass(frozen=True)
class MuonBlocks:
    """A Muon matrix (or a fused 3-D expert tensor's every expert's) that is `count` matrices stacked by rows, each
    orthogonalised on its own: transformers' gate_up_proj (an expert's gate and up projections), or MLA's per-head
    projections (one block per attention head, per-head Muon). Set as the parameter's
    `is_expert_group` and `muon_num_heads`, the two tags DeepSpeed passes from a parameter to muon_update (ZeRO 1/2
    pass the first, ZeRO-3 the second); muon_update_in_blocks reads it there."""
    count: int


def muon_update_in_blocks(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = 5,
                          nesterov: bool = True, ns_method: str = "gram", is_expert_group=False, num_heads=None,
                          fp32: bool = False):
    """DeepSpeed's muon_update, with a MuonBlocks tensor viewed as its blocks: [(E,) k*r, c] as [(E*)k, r, c], one
    orthogonalisation each (momentum is elementwise, so the view changes nothing else); `fp32`: Newton-Schulz in
    fp32 whatever the device supports (DeepSpeed picks fp16 or bf16 where it can, ns_compute_dtype)."""
    blocks = next((tag for tag in (is_expert_group, num_heads) if isinstance(tag, MuonBlocks)), None)
    with attribute_replaced(original_muon, "ns_compute_dtype", _fp32) if fp32 else contextlib.nullcontext():
        if blocks is None:
            return _MUON_UPDATE(grad, momentum, beta, ns_steps, nesterov, ns_method, is_expert_group=is_expert_group,
                                num_heads=num_heads)
        rows, cols = grad.shape[-2:]
        blocked = (-1, rows // blocks.count, cols)
        update = _MUON_UPDATE(grad.view(blocked), momentum.view(blocked), beta, ns_steps, nesterov, ns_method,
                              is_expert_group=True)
    return update.view(grad.shape)


def _fp32(ns_method: str = "gram") -> torch.dtype:  # original_muon.ns_compute_dtype's signature
    return torch.float32


@contextlib.contextmanager
def _muon_update_is(fn: Callable) -> Iterator[None]:
    # DeepSpeed's ZeRO optimizers import muon_update from its module at each call: replaced there for the call.
    with attribute_replaced(original_muon, "muon_update", fn):
        yield


def muon_after_the_norm(optimizer, fp32: bool = False) -> None:
    """DeepSpeed's ZeRO 1-3 optimizers (with MuonWithAuxAdam) run Muon's momentum and Newton-Schulz on the gradient
    after the step's gradient norm, clipped by it, not before it, and each fused gate_up_proj per projection
    (MuonBlocks).

    DeepSpeed runs Muon before the norm (ZeRO 1/2 as it flattens each group's reduced gradients into the partition,
    ZeRO-3 on the accumulated partitions just before the norm), so its norm, the logged grad_norm and gradient
    clipping saw the orthogonalised updates (DeepSpeed #7776, #8439). Here the norm is the gradient's; Muon then
    runs on the gradient divided as DeepSpeed divides AdamW's (loss scale, clip), and its update is written back
    multiplied by the same divisor, which DeepSpeed's unscale_and_clip_grads takes off again. `fp32`: Newton-Schulz
    in fp32 (muon_update_in_blocks)."""
    update = functools.partial(muon_update_in_blocks, fp32=fp32)
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        _stage3_muon_after_the_norm(optimizer, update)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):
        _stage12_muon_after_the_norm(optimizer, update)
    else:
        raise ValueError(f"Muon runs in DeepSpeed's ZeRO 1-3 optimizers; this engine built {type(optimizer).__name__}")


def _stage12_muon_after_the_norm(optimizer: DeepSpeedZeroOptimizer, update: Callable) -> None:
    """ZeRO 1/2: get_flat_partition keeps the reduced gradients (the partition holds views of them) and records
    Muon's calls, which run after the norm, on the same tensors."""
    recorded: dict[int, list] = {}  # parameter group -> this boundary's Muon calls (grad, momentum, arguments)
    flat_partition, global_norm = optimizer.get_flat_partition, optimizer.scaled_global_norm

    def get_flat_partition(tensor_list, first_offset, partition_size, dtype, device, param_group_idx,
                           return_tensor_list=False):
        calls = recorded[param_group_idx] = []

        def record(grad, momentum, *args, **kwargs):
            calls.append((grad, momentum, args, kwargs))
            return grad  # flattened as it is: the partition's views of it see the update written back later
        with _muon_update_is(record):
            flat = flat_partition(tensor_list, first_offset, partition_size, dtype, device, param_group_idx,
                                  return_tensor_list)
        if calls and not return_tensor_list:
            raise RuntimeError("muon_after_the_norm: DeepSpeed flattened a Muon group's gradients into a copy; its "
                               "update would be lost (DeepSpeed's ZeRO 1/2 changed: see utils/private_optimizer.py)")
        optimizer.groups_lacking_loss_scale.clear()  # each group holds gradients, loss-scaled, until the norm
        return flat

    def scaled_global_norm(norm_type=2):
        total = global_norm(norm_type)
        divisor = _clip_divisor(optimizer, total)
        for calls in recorded.values():
            for grad, momentum, args, kwargs in calls:
                grad.mul_(1.0 / divisor)
                grad.copy_(update(grad, momentum, *args, **kwargs) * divisor)
        recorded.clear()
        return total

    optimizer.get_flat_partition = get_flat_partition
    optimizer.scaled_global_norm = scaled_global_norm


def _clip_divisor(optimizer, total_norm: torch.Tensor):
    """What ZeRO 1/2's unscale_and_clip_grads divides every gradient by for this norm (loss scale times the clip
    factor), computed as it does (reproduced: DeepSpeed computes it inline)."""
    if optimizer.clip_grad <= 0:
        return optimizer.loss_scale
    clip = ((total_norm / optimizer.loss_scale) + 1e-6) / optimizer.clip_grad
    return torch.clamp(clip, min=1.0) * optimizer.loss_scale


def _stage3_muon_after_the_norm(optimizer: DeepSpeedZeroOptimizer_Stage3, update: Callable) -> None:
    """ZeRO-3: the norm of each sub-group's accumulated gradient partitions is taken before Muon runs on them
    (_apply_muon_to_accumulated_grads), and step() is given those norms."""
    apply_muon, norm_groups = optimizer._apply_muon_to_accumulated_grads, optimizer._get_norm_groups
    norms: list = []

    def apply_muon_after_the_norm():
        optimizer.sub_groups_lacking_loss_scale.clear()
        norms[:] = norm_groups()
        divisor = _clip_divisor(optimizer, combine_grad_norm_groups(norms))
        muon = [part for i, group in enumerate(optimizer.fp16_groups)
                if group and optimizer.sub_groups_using_muon[i] for part in optimizer.averaged_gradients[i]]
        for partition in muon:
            partition.mul_(1.0 / divisor)
        with _muon_update_is(update):
            apply_muon()
        for partition in muon:
            partition.mul_(divisor)
        optimizer.sub_groups_lacking_loss_scale.clear()  # the updates are scaled like gradients again

    def step_norms() -> list:  # once, the step's; any other caller gets them afresh
        taken, norms[:] = list(norms), []
        return taken or norm_groups()

    optimizer._apply_muon_to_accumulated_grads = apply_muon_after_the_norm
    optimizer._get_norm_groups = step_norms
