"""Muon's momentum through a universal checkpoint (ZeRO 1/2): DeepSpeed's converter carries AdamW's moments only
(it reads exp_avg from every optimizer group), so deepseek-ds carries Muon's itself.

ZeRO 1/2 keep, on each rank and for its Muon group, one flat momentum buffer holding every matrix that overlaps the
rank's slice of the group whole, in the group's order (the order of the shard's param_slice_mappings). The
conversion reads each matrix's momentum from there (a matrix at a slice's edge is in two shards, the same in both)
into `muon_momentum.pt` beside the universal checkpoint's parameter folders, by the parameter names of the layout it
is converted for; the Muon parameters' folders keep only their weights (DeepSpeed's converter is handed zero
moments for them, then they are removed). A resumed engine's Muon groups get their buffers back from that file,
each in its own ranks' order."""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator

import torch
from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint

from ..utils.private_api import attribute_replaced
from .format import CheckpointError

MOMENTUM_FILE = "muon_momentum.pt"
_MOMENTUM, _MOMENTS = "momentum_buffer", ("exp_avg", "exp_avg_sq")
_OPTIMIZER, _STATE, _SLICES = "optimizer_state_dict", "base_optimizer_state", "param_slice_mappings"


def _muon_groups(optimizer_sd: dict) -> list[int]:
    return [g for g, state in optimizer_sd[_STATE]["state"].items() if _MOMENTUM in state]


def read_momentum(tag_dir: str) -> dict[str, torch.Tensor]:
    """Parameter name (the saved layout's) -> its Muon momentum, flat, from every ZeRO 1/2 shard of the tag."""
    shards = [torch.load(f, map_location="cpu", weights_only=False)[_OPTIMIZER]
              for f in sorted(glob.glob(os.path.join(tag_dir, "*optim_states.pt")))]
    numels: dict[str, int] = {}  # the shards' slices of a matrix add up to the whole of it
    for sd in shards:
        for g in _muon_groups(sd):
            for name, fragment in sd[_SLICES][g].items():
                numels[name] = numels.get(name, 0) + fragment.numel
    momentum: dict[str, torch.Tensor] = {}
    for sd in shards:
        for g in _muon_groups(sd):
            buffer, offset = sd[_STATE]["state"][g][_MOMENTUM], 0
            for name in sd[_SLICES][g]:
                momentum.setdefault(name, buffer[offset:offset + numels[name]].clone())
                offset += numels[name]
            if offset != buffer.numel():
                raise CheckpointError(f"{tag_dir}: a Muon momentum buffer of {buffer.numel()} elements holds "
                                      f"{offset} of its matrices': not a ZeRO 1/2 Muon checkpoint deepseek-ds knows")
    return momentum


@contextlib.contextmanager
def zero_moments_for_muon() -> Iterator[None]:
    """DeepSpeed's converter, for the block, reads zero AdamW moments in each shard's Muon groups (the shapes of its
    fp32 slice) instead of failing on their absence."""
    state_of = DeepSpeedCheckpoint.get_zero_checkpoint_state

    def with_zero_moments(self, *args, **kwargs) -> dict:
        sd = state_of(self, *args, **kwargs)
        optimizer = sd[_OPTIMIZER]
        for g in _muon_groups(optimizer):
            fp32 = optimizer["single_partition_of_fp32_groups"][g]
            optimizer[_STATE]["state"][g].update({key: torch.zeros_like(fp32) for key in _MOMENTS})
        return sd

    with attribute_replaced(DeepSpeedCheckpoint, "get_zero_checkpoint_state", with_zero_moments):
        yield


def write_momentum(universal: str, momentum: dict[str, torch.Tensor], rename: dict[str, str]) -> None:
    """Keep `momentum` in the universal checkpoint `universal` (a tmp directory being built) under the names
    `rename` gives, and drop the converter's zero moments of those parameters."""
    for name in momentum:
        for key in _MOMENTS:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(universal, "zero", rename.get(name, name), f"{key}.pt"))
    torch.save({rename.get(name, name): t for name, t in momentum.items()}, os.path.join(universal, MOMENTUM_FILE))


def restore_momentum(engine, universal: str) -> None:
    """Give each Muon group of a ZeRO 1/2 engine just loaded from `universal` its momentum buffer: the matrices of
    its slice, whole, in order, as DeepSpeed's Muon keeps them."""
    saved = torch.load(os.path.join(universal, MOMENTUM_FILE), map_location="cpu", weights_only=True)
    optimizer, names = engine.optimizer, {p: n for n, p in engine.module.named_parameters()}
    for i, params in enumerate(optimizer.params_in_partition):
        if not params or not getattr(params[0], "use_muon", False):
            continue
        missing = [names[p] for p in params if names[p] not in saved]
        if missing:
            raise CheckpointError(f"{universal}: no Muon momentum for {', '.join(missing[:3])}: the checkpoint was "
                                  "not trained with Muon for these parameters")
        flat = optimizer.optimizer.param_groups[i]["params"][0]
        optimizer.optimizer.state[flat][_MOMENTUM] = torch.cat([saved[names[p]] for p in params]).to(flat.device)
