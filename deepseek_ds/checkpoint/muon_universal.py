"""Muon's momentum through a universal checkpoint: DeepSpeed's converter carries AdamW's moments only (it reads
exp_avg from every optimizer group, and its loaders know those keys), so deepseek-ds carries Muon's itself.

ZeRO 1/2 keep, on each rank and for its Muon group, one flat momentum buffer holding every matrix that overlaps the
rank's slice of the group whole, in the group's order (the order of the shard's param_slice_mappings); ZeRO-3
partitions it as it partitions the weights (each matrix's 1/dp slice, padded, in sub-group order). The conversion
reads each matrix's whole momentum from the shards into `muon_momentum.pt` beside the universal checkpoint's
parameter folders, by the parameter names of the layout it is converted for (DeepSpeed's converter is handed zero
AdamW moments for the Muon groups meanwhile). A resumed engine's Muon groups get their buffers back from that
file, each laid out as its ZeRO stage keeps it, and the zero moments DeepSpeed's loader put beside them go."""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from deepspeed.checkpoint import ds_to_universal
from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..utils.private_api import attribute_replaced
from .format import CheckpointError

MOMENTUM_FILE = "muon_momentum.pt"
_MOMENTUM, _MOMENTS = "momentum_buffer", ("exp_avg", "exp_avg_sq")
_OPTIMIZER, _STATE, _SLICES = "optimizer_state_dict", "base_optimizer_state", "param_slice_mappings"
_STAGE3_STATE = "optimizer_state_dict"  # ZeRO-3: the torch optimizer's state dict, inside the shard's _OPTIMIZER
_DP_RANK = re.compile(r"zero_pp_rank_(\d+)_")  # a shard file's data-parallel rank


def _muon_groups(states: dict) -> list[int]:
    return [g for g, state in states.items() if _MOMENTUM in state]


def _shards(tag_dir: str) -> list[dict]:
    """Every optimizer shard of the tag, in data-parallel rank order."""
    files = sorted(glob.glob(os.path.join(tag_dir, "*optim_states.pt")),
                   key=lambda f: int(_DP_RANK.search(os.path.basename(f)).group(1)))
    return [torch.load(f, map_location="cpu", weights_only=False)[_OPTIMIZER] for f in files]


def read_momentum(tag_dir: str, zero_stage: int) -> dict[str, torch.Tensor]:
    """Parameter name (the saved layout's) -> its Muon momentum, flat and whole, from every shard of the tag."""
    return _read_stage3(tag_dir) if zero_stage == 3 else _read_stage12(tag_dir)


def _read_stage3(tag_dir: str) -> dict[str, torch.Tensor]:
    """ZeRO-3: each sub-group's buffer is every rank's slice of each matrix in turn (math.ceil(numel / dp) each, as
    ZeRO-3 partitions a parameter); the sub-groups' matrices are the model states' param_shapes."""
    shards = [sd[_STAGE3_STATE]["state"] for sd in _shards(tag_dir)]
    model_states = sorted(glob.glob(os.path.join(tag_dir, "*model_states.pt")))[0]
    shapes = torch.load(model_states, map_location="cpu", weights_only=False)["param_shapes"]
    momentum: dict[str, torch.Tensor] = {}
    for g in _muon_groups(shards[0]):
        offset = 0
        for name, shape in shapes[g].items():
            numel = math.prod(shape)
            part = math.ceil(numel / len(shards))
            momentum[name] = torch.cat([s[g][_MOMENTUM][offset:offset + part] for s in shards])[:numel].clone()
            offset += part
    return momentum


def _read_stage12(tag_dir: str) -> dict[str, torch.Tensor]:
    shards = _shards(tag_dir)
    numels: dict[str, int] = {}  # the shards' slices of a matrix add up to the whole of it
    for sd in shards:
        for g in _muon_groups(sd[_STATE]["state"]):
            for name, fragment in sd[_SLICES][g].items():
                numels[name] = numels.get(name, 0) + fragment.numel
    momentum: dict[str, torch.Tensor] = {}
    for sd in shards:
        for g in _muon_groups(sd[_STATE]["state"]):
            buffer, offset = sd[_STATE]["state"][g][_MOMENTUM], 0
            for name in sd[_SLICES][g]:
                momentum.setdefault(name, buffer[offset:offset + numels[name]].clone())
                offset += numels[name]
            if offset != buffer.numel():
                raise CheckpointError(f"{tag_dir}: a Muon momentum buffer of {buffer.numel()} elements holds "
                                      f"{offset} of its matrices': not a ZeRO 1/2 Muon checkpoint deepseek-ds knows")
    return momentum


def _with_zero_moments(states: dict, fp32_groups: list) -> None:
    for g in _muon_groups(states):
        states[g].update({key: torch.zeros_like(fp32_groups[g]) for key in _MOMENTS})


@contextlib.contextmanager
def zero_moments_for_muon() -> Iterator[None]:
    """DeepSpeed's converter, for the block, reads zero AdamW moments in each shard's Muon groups (the shapes of its
    fp32 slice) instead of failing on their absence: ZeRO 1/2 through the checkpoint reader's state, ZeRO-3 (whose
    extraction loads each shard file itself) from a copy of the shard file that has them."""
    state_of, extract_stage3 = DeepSpeedCheckpoint.get_zero_checkpoint_state, ds_to_universal.extract_zero_shards_stage3

    def state_with_zero_moments(self, *args, **kwargs) -> dict:
        sd = state_of(self, *args, **kwargs)
        _with_zero_moments(sd[_OPTIMIZER][_STATE]["state"], sd[_OPTIMIZER]["single_partition_of_fp32_groups"])
        return sd

    def extract_stage3_with_zero_moments(optim_files_grid, *args, **kwargs):
        tp_index, dp_index = kwargs.get("indices", args[3] if len(args) > 3 else None)
        sd = torch.load(optim_files_grid[tp_index][dp_index], map_location="cpu", weights_only=False)
        _with_zero_moments(sd[_OPTIMIZER][_STAGE3_STATE]["state"], sd[_OPTIMIZER]["fp32_flat_groups"])
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(sd, os.path.join(tmp, "optim_states.pt"))
            grid = [list(row) for row in optim_files_grid]
            grid[tp_index][dp_index] = os.path.join(tmp, "optim_states.pt")
            return extract_stage3(grid, *args, **kwargs)

    with attribute_replaced(DeepSpeedCheckpoint, "get_zero_checkpoint_state", state_with_zero_moments), \
            attribute_replaced(ds_to_universal, "extract_zero_shards_stage3", extract_stage3_with_zero_moments):
        yield


def write_momentum(universal: str, momentum: dict[str, torch.Tensor], rename: dict[str, str]) -> None:
    """Keep `momentum` in the universal checkpoint `universal` (a tmp directory being built) under the names
    `rename` gives. ZeRO-3's loader reads the optimizer's step from its sub-group 0, which may be a Muon group (no
    step of its own): the global state's Muon groups get the others' step."""
    torch.save({rename.get(name, name): t for name, t in momentum.items()}, os.path.join(universal, MOMENTUM_FILE))
    path = os.path.join(universal, "zero", "optimizer_state.pt")
    sd = torch.load(path, map_location="cpu", weights_only=False)
    states = (sd.get(_STAGE3_STATE) or {}).get("state")
    steps = [state["step"] for state in (states or {}).values() if "step" in state]
    if steps:
        for state in states.values():
            state.setdefault("step", steps[0])
        torch.save(sd, path)


def restore_momentum(engine, universal: str) -> None:
    """Give each Muon group of a ZeRO 1-3 engine just loaded from `universal` its momentum buffer, laid out as its
    stage keeps it, in place of the zero AdamW moments DeepSpeed's loader gave it."""
    saved = torch.load(os.path.join(universal, MOMENTUM_FILE), map_location="cpu", weights_only=True)
    optimizer, names = engine.optimizer, engine.param_names  # {parameter: its name in engine.module}
    stage3 = isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)
    groups = optimizer.fp16_groups if stage3 else optimizer.params_in_partition
    for i, params in enumerate(groups):
        if not params or not getattr(params[0], "use_muon", False):
            continue
        missing = [names[p] for p in params if names[p] not in saved]
        if missing:
            raise CheckpointError(f"{universal}: no Muon momentum for {', '.join(missing[:3])}: the checkpoint was "
                                  "not trained with Muon for these parameters")
        if stage3:
            flat, rank = optimizer.fp32_partitioned_groups_flat[i], dist.get_rank(optimizer.dp_process_group)
            buffer = torch.cat([_slice(saved[names[p]], p.partition_numel(), rank) for p in params])
        else:
            flat = optimizer.optimizer.param_groups[i]["params"][0]
            buffer = torch.cat([saved[names[p]] for p in params])
        state = optimizer.optimizer.state[flat]
        for key in _MOMENTS:
            state.pop(key, None)
        state[_MOMENTUM] = buffer.to(device=flat.device)
    if stage3:
        _restore_group_settings(optimizer.optimizer, universal)


def _restore_group_settings(optimizer: torch.optim.Optimizer, universal: str) -> None:
    """ZeRO-3's universal loader gives every parameter group the settings of the saved group 0 (it assumes they are
    all alike); Muon's and AdamW's halves are not (lr, momentum, use_muon): each group gets its own back."""
    sd = torch.load(os.path.join(universal, "zero", "optimizer_state.pt"), map_location="cpu", weights_only=False)
    for group, saved in zip(optimizer.param_groups, sd[_STAGE3_STATE]["param_groups"], strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})


def _slice(whole: torch.Tensor, part: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s ZeRO-3 slice of a flat tensor (`part` elements, zero-padded past its end)."""
    piece = whole[rank * part:(rank + 1) * part]
    return torch.cat([piece, piece.new_zeros(part - piece.numel())])
