"""Model-state bytes of one rank (parameters, gradients, optimizer states), laid out as DeepSpeed 0.19 lays them out,
padding included, so the prediction equals what bench zero's worker measures from the engine to the byte.

ZeRO 1/2 (runtime/zero/stage_1_and_2.py) flatten each parameter group into one buffer padded to a multiple of
nccl_start_alignment_factor (2) x the group's partition count, and give each rank one contiguous 1/N of it: the
fp32 master copy and Adam's two moments cover that slice. ZeRO-2's gradient buffer (grads_in_partition) holds every
parameter that overlaps the rank's slice whole; ZeRO-1 keeps whole gradients until the accumulation boundary.
ZeRO-3 (partition_parameters.py) pads each parameter to a multiple of N and keeps 1/N of it, plus parameters of at
most stage3_param_persistence_threshold elements whole on every rank. Expert parameters (AutoEP) form their own
group, partitioned over the expert-data-parallel group (data parallel / EP) instead of the data-parallel one.
With DeepSpeed's Muon (engine.py's _muon_param_groups) the Muon-tagged matrices form one group (sorted by shape) and
the rest a second, each flattened and padded on its own; utils/zero_partition.py's optimizer_state_bytes says what each keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..utils.zero_partition import (
    ADAM_BYTES,
    MASTER_BYTES,
    muon_groups,
    optimizer_state_bytes,
    overlapping_numel,
    zero3_partition_numel,
    zero12_flat_numel,
)
from .params import Param

# DeepSpeed splits a MoE group above this many elements (moe/utils.py split_params_into_different_moe_groups...).
MAX_MOE_GROUP = 178956971
PERSISTENCE_DEFAULT = 100000  # DeepSpeedZeroConfig.param_persistence_threshold


@dataclass(frozen=True)
class ZeroSettings:
    stage: int
    param_bytes: int            # 4 fp32, 2 bf16 / fp16
    persistence_threshold: int  # ZeRO-3: parameters this small stay whole on every rank
    offload_optimizer: bool = False
    offload_params: bool = False
    muon: bool = False  # the JSON selects DeepSpeed's Muon (with AdamW for the parameters the rule leaves it)


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int
    offloaded: int  # of those, the bytes kept in host memory


def _groups(params: list[Param], muon: bool) -> list[tuple[list[int], bool, bool]]:
    """(element counts, is_expert, is_muon) per optimizer parameter group, as the engine builds them from build_run's
    single group: without experts one group (with Muon two: the Muon matrices, then the rest); with AutoEP the
    dense parameters, then the experts in groups of at most MAX_MOE_GROUP elements (validate() refuses AutoEP with
    Muon)."""
    if muon:
        trainable = [p for p in params if p.trainable]
        return [(g, False, m) for g, m in muon_groups([p.numel for p in trainable], [p.muon_shape for p in trainable],
                                                      [p.muon for p in trainable])]
    dense = [p.numel for p in params if p.trainable and not p.expert]
    experts, groups = [p.numel for p in params if p.trainable and p.expert], [(dense, False)]
    current: list[int] = []
    for n in experts:
        if current and sum(current) + n > MAX_MOE_GROUP:
            groups.append((current, True))
            current = []
        current.append(n)
    if current:
        groups.append((current, True))
    return [(g, expert, False) for g, expert in groups if g]


def _zero12(numels: list[int], n: int, rank: int, z: ZeroSettings, muon: bool) -> tuple[int, int, int]:
    flat = zero12_flat_numel(numels, n)
    part = flat // n
    # ZeRO-1: whole gradients in the parameters' .grad until the boundary; ZeRO-2: the partition buffer. On the last
    # rank, the zeros that pad its gradient list to the partition at the step (a group not a multiple of 2 N long).
    held = sum(numels) if z.stage == 1 else overlapping_numel(numels, rank * part, (rank + 1) * part)
    grads = z.param_bytes * (held + (flat - sum(numels) if rank == n - 1 else 0))
    # Muon's momentum is in the gradients' dtype (DeepSpeed's _muon_momentum_buffer).
    return z.param_bytes * flat, grads, optimizer_state_bytes(numels, muon, n, rank, z.stage, z.param_bytes)


def _muon_grads(groups: list[tuple[list[int], bool, bool]], n: int, rank: int, z: ZeroSettings) -> int:
    """ZeRO 1/2 with Muon: the most gradient bytes the rank holds. Before the accumulation boundary ZeRO-1 holds every
    gradient whole (ZeRO-2 less than after it); from the boundary to the step, the parameters' gradients are gone
    and the rank holds the reduced gradient of every parameter overlapping its slice of each group, whole (Muon's
    update is written back into it after the norm, utils/private_optimizer.py) and, on the last rank, the zeros
    padding each group's list to the partition."""
    boundary = 0
    for numels, _, _ in groups:
        flat = zero12_flat_numel(numels, n)
        part = flat // n
        boundary += overlapping_numel(numels, rank * part, (rank + 1) * part)
        boundary += flat - sum(numels) if rank == n - 1 else 0
    whole = sum(sum(numels) for numels, _, _ in groups) if z.stage == 1 else 0
    return z.param_bytes * max(whole, boundary)


def _zero3(numels: list[int], n: int, z: ZeroSettings, muon: bool = False) -> tuple[int, int, int]:
    part = zero3_partition_numel(numels, n)
    # A persistent parameter stays gathered: a view of its all-gather buffer, N partitions long.
    persistent = sum(-(-x // n) * n for x in numels if x <= z.persistence_threshold)
    # Muon's momentum is in the communication dtype, the parameters' by default (stage3.py's _create_momentum_buffer).
    return (z.param_bytes * (part + persistent), z.param_bytes * part,
            optimizer_state_bytes(numels, muon, n, 0, 3, z.param_bytes))


def state_bytes(params: list[Param], z: ZeroSettings, dp: int, ep: int, dp_rank: int) -> StateBytes:
    """Bytes one rank holds. `dp_rank`: the rank's index in its data-parallel group (ZeRO-2's slices hold different
    parameters whole, so ranks differ by a few parameters); the expert group's index is dp_rank // ep."""
    total = [0, 0, 0]
    for numels, expert, muon in _groups(params, z.muon):
        n = dp // ep if expert else dp
        rank = dp_rank // ep if expert else dp_rank
        if z.stage == 0:
            size = sum(numels)
            # fp32: Adam updates the parameters themselves; mixed precision adds an fp32 master copy.
            master = MASTER_BYTES * size if z.param_bytes != MASTER_BYTES else 0
            got = (z.param_bytes * size, z.param_bytes * size, ADAM_BYTES * size + master)
        elif z.stage in (1, 2):
            got = _zero12(numels, n, rank, z, muon)
        else:
            got = _zero3(numels, n, z, muon)
        total = [t + g for t, g in zip(total, got)]
    params_b, grads_b, optim_b = total
    if z.muon and z.stage in (1, 2):
        grads_b = _muon_grads(_groups(params, True), dp, dp_rank, z)
    # Frozen weights (LoRA's base, V4's indexers) stay out of ZeRO's flat groups: whole on every rank, or under
    # ZeRO-3 partitioned like the others (1/N each, and whole besides up to the persistence threshold).
    frozen = [p.numel for p in params if not p.trainable]
    params_b += z.param_bytes * (_zero3(frozen, dp, z)[0] // z.param_bytes if z.stage == 3 else sum(frozen))
    offloaded = (optim_b if z.offload_optimizer else 0) + (params_b if z.offload_params else 0)
    return StateBytes(params_b, grads_b, optim_b, offloaded)
