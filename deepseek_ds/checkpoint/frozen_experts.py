"""LoRA checkpoints under AutoEP without the frozen experts. DeepSpeed writes every routed expert's weights into its
own file (`layer_<L>_expert_<E>_mp_rank_<M>_model_states.pt`) whatever exclude_frozen_parameters says, and its loader
requires every such file: at DeepSeek-V3 scale that is the whole 1.3 TB of experts in each adapter checkpoint. A
LoRA run's experts are the base's, read from model.path at build time, so each such file is written as a marker and,
at resume, read back as this rank's experts as they are now (unchanged since the build)."""

from __future__ import annotations

import os
import re

from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from torch import nn

from ..utils.private_api import expert_parallel_rank

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_\d+_model_states\.pt$")
MARKER = "deepseek_ds_frozen_experts_from_model_path"
_WEIGHTS = ("w1", "w2", "w3")  # AutoEP's grouped expert tensors, as DeepSpeed names them in these files


def marker_for(path: str) -> dict | None:
    """What to write instead of an expert file's state dict (None: not an expert file)."""
    return {MARKER: True} if EXPERT_FILE.match(os.path.basename(str(path))) else None


class ExpertsFromModule:
    """While DeepSpeed's load_checkpoint runs (io_engine.loading): a marker file reads as the module's own experts, in
    the keys DeepSpeed's loader expects (`<block>.experts.w1.<global expert>`, one 2-D tensor each)."""

    def __init__(self, module: nn.Module):
        self.blocks = [(name, m) for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)]  # layer ids

    def read(self, state, path):
        """What a loaded file's `state` stands for: the experts for a marker, else itself."""
        if not (isinstance(state, dict) and state.get(MARKER)):
            return state
        layer, expert = map(int, EXPERT_FILE.match(os.path.basename(str(path))).groups())
        name, block = self.blocks[layer]
        local = expert - expert_parallel_rank(block.ep_group_name) * block.num_local_experts
        prefix = f"{name}." if name else ""
        return {f"{prefix}experts.{w}.{expert}": getattr(block.experts, w)[local].detach().cpu().clone()
                for w in _WEIGHTS}


def holds_frozen_experts(module: nn.Module) -> bool:
    """Whether AutoEP experts of this module are frozen (LoRA), so their files need not be written."""
    return any(isinstance(m, AutoEPMoELayer) and not any(p.requires_grad for p in (getattr(m.experts, w)
                                                                                  for w in _WEIGHTS))
               for m in module.modules())
