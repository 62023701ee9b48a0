"""Gradient clipping per group of parameters, for DeepSeek-V3.2's sparse stage: the language model learns from its
loss and the lightning indexers from theirs (disjoint parameters, models/deepseek_v32/indexer.py), so one norm over
both would let a large gradient of either loss shrink the other's step. Each group is clipped to train.grad_clip by
its own norm; the logged grad_norm stays the norm of all gradients, and each group's norm is logged beside it."""

from __future__ import annotations

import torch
from deepspeed.runtime.utils import combine_grad_norm_groups
from torch import nn

from ..config import RunConfig
from ..models.deepseek_v32.indexer import TrainableIndexer
from ..utils.private_optimizer import clip_by_group_norms


def clipped_apart(cfg: RunConfig) -> bool:
    """indexer.stage sparse: the language model and the indexers train on their own losses, in groups of their own."""
    return cfg.indexer.stage == "sparse"


def _indexer_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, TrainableIndexer) for p in m.parameters()}


def indexer_parameter_groups(model: nn.Module, trainable: list[nn.Parameter]) -> list[dict]:
    """The engine's parameter groups: the language model's, then the indexers' (this order on every pipeline stage:
    DeepSpeed reduces each group's norm over the stages by its position)."""
    indexer = _indexer_ids(model)
    groups = [[p for p in trainable if id(p) not in indexer], [p for p in trainable if id(p) in indexer]]
    if not all(groups):
        raise ValueError("indexer.stage sparse: each pipeline stage needs both language-model and indexer parameters "
                         f"to clip them apart; this one has {len(groups[0])} and {len(groups[1])}")
    # Named: DeepSpeed's MoE split of the groups (expert parallelism) keys each group's expert part by its name.
    return [{"name": name, "params": g} for name, g in zip(("lm", "indexer"), groups)]


class GroupClipping:
    """Installed on a ZeRO 1-3 engine built with indexer_parameter_groups: clips each of NAMES by its own norm and
    keeps the step's norms (device tensors, no host read) for the metrics."""

    NAMES = ("grad_norm_lm", "grad_norm_indexer")

    def __init__(self, engine, model: nn.Module):
        indexer = _indexer_ids(model)
        self.optimizer = engine.optimizer
        groups = clip_by_group_norms(self.optimizer, self._norm_for)
        self._is_indexer = []
        for params in groups:
            kinds = {id(p) in indexer for p in params}
            if len(kinds) != 1:
                raise ValueError("GroupClipping: an optimizer group mixes indexer and language-model parameters; "
                                 "build the engine from indexer_parameter_groups")
            self._is_indexer.append(kinds.pop())
        self._step_norms: torch.Tensor | None = None  # (lm, indexer), loss-scaled as DeepSpeed's group norms

    def _norm_for(self, norms: list, group: int) -> torch.Tensor:
        if group == 0:  # DeepSpeed clips its groups in order: the step's two norms, once
            self._step_norms = torch.stack([
                combine_grad_norm_groups([n for n, ix in zip(norms, self._is_indexer) if ix is kind])
                for kind in (False, True)])
        return self._step_norms[int(self._is_indexer[group])]

    def take(self) -> torch.Tensor | None:
        """The last optimizer step's norms before clipping, unscaled (None when the step was skipped)."""
        norms, self._step_norms = self._step_norms, None
        return None if norms is None else norms / self.optimizer.loss_scale
