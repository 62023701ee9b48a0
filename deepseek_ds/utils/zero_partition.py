"""How many elements of a parameter group one rank's ZeRO partition holds, padding included, as DeepSpeed 0.19
lays it out, and the optimizer-state bytes of a partition under AdamW or Muon: the one copy of this arithmetic that
`bench zero` (whose measurement must equal it) and `plan` (which predicts from it) share. DeepSpeed computes it
inside its optimizers and exposes no function for it."""

from __future__ import annotations

NCCL_START_ALIGNMENT = 2  # stage_1_and_2.py's nccl_start_alignment_factor
MASTER_BYTES = 4          # fp32 master weights (ZeRO keeps them even when training in fp32)
ADAM_BYTES = 8            # Adam's exp_avg and exp_avg_sq, fp32


def zero12_flat_numel(numels: list[int], n: int) -> int:
    """ZeRO 1/2 flatten the group and pad it to a multiple of 2 x N elements; each rank holds one contiguous 1/N."""
    align = NCCL_START_ALIGNMENT * n
    return -(-sum(numels) // align) * align


def zero3_partition_numel(numels: list[int], n: int) -> int:
    """ZeRO-3 pads every parameter to a multiple of N and gives each rank 1/N of each."""
    return sum(-(-x // n) for x in numels)


def partition_numel(numels: list[int], n: int, stage: int) -> int:
    """Elements of one rank's optimizer partition of a group (stage 0 keeps all)."""
    if stage == 0:
        return sum(numels)
    if stage == 3:
        return zero3_partition_numel(numels, n)
    return zero12_flat_numel(numels, n) // n


def muon_groups(numels: list[int], shapes: list, muon: list[bool]) -> list[tuple[list[int], bool]]:
    """(element counts, is_muon) of the groups DeepSpeed's Muon makes of a trainable parameter list (engine.py's
    _muon_param_groups): the Muon matrices, which MuonWithAuxAdam sorts by shape, largest first (torch.Size
    compares as a tuple: a (384, 128) matrix before an (8, 256, 128) expert tensor), ties in the order given
    (original_muon.py); then the rest, in the order given. Empty groups are left out."""
    matrices = sorted((i for i, m in enumerate(muon) if m), key=lambda i: tuple(shapes[i]), reverse=True)
    rest = [x for x, m in zip(numels, muon) if not m]
    return [(g, m) for g, m in (([numels[i] for i in matrices], True), (rest, False)) if g]


def overlapping_numel(numels: list[int], start: int, end: int) -> int:
    """Elements of the parameters of a flat group that overlap [start, end), each whole (stage_1_and_2.py's
    get_partition_info: the rank's params_in_partition)."""
    total, offset = 0, 0
    for n in numels:
        if start <= offset < end or offset < start < offset + n:
            total += n
        offset += n
    return total


def optimizer_state_bytes(numels: list[int], muon: bool, n: int, rank: int, stage: int, momentum_bytes: int) -> int:
    """Bytes of one ZeRO (stage >= 1) parameter group's optimizer state on rank `rank` of its `n`: the fp32 master
    partition, plus AdamW's two fp32 moments over it or, for a group of Muon matrices (DeepSpeed's MuonWithAuxAdam),
    a momentum buffer of `momentum_bytes` per element (the gradients' dtype at ZeRO 1/2, the communication dtype at
    ZeRO-3). ZeRO-3 partitions it like the master weights. ZeRO 1/2 orthogonalise whole matrices: each rank keeps
    the momentum of every matrix that overlaps its slice, whole, twice (the committed buffer in the optimizer's
    state and the copy this step's update is staged in until the overflow check passes, _muon_staging_momentum)."""
    part = partition_numel(numels, n, stage)
    if not muon:
        return (MASTER_BYTES + ADAM_BYTES) * part
    if stage == 3:
        return MASTER_BYTES * part + momentum_bytes * part
    return MASTER_BYTES * part + 2 * momentum_bytes * overlapping_numel(numels, rank * part, (rank + 1) * part)
