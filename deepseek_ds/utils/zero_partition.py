"""How many elements of a parameter group one rank's ZeRO partition holds, padding included, as DeepSpeed 0.19
lays it out: the one copy of this arithmetic that `bench zero` (whose measurement must equal it) and `plan` (which
predicts from it) share. DeepSpeed computes it inside its optimizers and exposes no function for it."""

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
