"""The whole model on one rank, as a copy of the engine's weights: what GRPO samples its rollouts from and keeps as
its reference. Under ZeRO-3 the parameters are gathered for the copy; under expert parallelism each AutoEP block's
experts (w1, w3, w2: this rank's share) are gathered over its expert-parallel group and put back into transformers'
fused gate_up_proj and down_proj, by the names checkpoint/tensor_names.py maps (the universal checkpoint's too)."""

from __future__ import annotations

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from torch import nn

from ..checkpoint.format import SEQUENTIAL
from ..checkpoint.tensor_names import container_entries, hf_tensors
from ..models.pipeline import build_model
from .run import Run

_EXPERTS = ("w1", "w2", "w3")  # AutoEP's grouped expert tensors: (local experts, ...) each


def _gathered_experts(block: AutoEPMoELayer) -> dict[str, torch.Tensor]:
    """experts.<w> -> the tensor of every expert, in expert order, from the block's expert-parallel group."""
    owners = [autoep_experts_for_rank(block.expert_placement_descriptor, r) for r in range(block.ep_size)]
    out = {}
    for name in _EXPERTS:
        local = getattr(block.experts, name).detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(block.ep_size)]
        dist.all_gather(parts, local, group=block.ep_group)
        whole = local.new_empty((block.num_experts, *local.shape[1:]))
        for experts, part in zip(owners, parts):
            whole[list(experts)] = part
        out[f"experts.{name}"] = whole
    return out


def _state_dict(run: Run) -> dict[str, torch.Tensor]:
    """The engine module's tensors by the names of a model built without AutoEP (the engine's own names when it has
    none); under ZeRO-3 call it with the parameters gathered."""
    module = run.engine.module
    state = module.state_dict()
    if run.cfg.parallel.expert_parallel == 1:
        return state
    for prefix, block in ((n, m) for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer)):
        state.update({f"{prefix}.{key}": t for key, t in _gathered_experts(block).items()})
    hf = hf_tensors(state, container_entries(run.model_config, SEQUENTIAL, autoep=True))
    return {name: hf[entry.hf] for name, entry in container_entries(run.model_config, SEQUENTIAL).items()}


def whole_copy(run: Run) -> nn.Module:
    """A model without AutoEP (the layers of SequentialLM) holding a copy of the engine's weights, on its device."""
    module, model = run.engine.module, build_model(run.model_config, 1, seed=None)
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=run.engine.zero_optimization_stage() == 3):
        model.load_state_dict(_state_dict(run))
    return model.to(run.engine.device)
