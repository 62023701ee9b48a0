"""LoRA checkpoints under AutoEP without the frozen experts. DeepSpeed writes every routed expert's weights into its
own file (`layer_<L>_expert_<E>_mp_rank_<M>_model_states.pt`) whatever exclude_frozen_parameters says, and its loader
requires every such file: at DeepSeek-V3 scale that is the whole 1.3 TB of experts in each adapter checkpoint. A
LoRA run's experts are the base's, read from model.path at build time, so each such file is written as a marker and,
at resume, read back as this rank's experts as they are now (unchanged since the build)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from deepspeed.utils import groups
from torch import nn

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_\d+_model_states\.pt$")
MARKER = "deepseek_ds_frozen_experts_from_model_path"
_WEIGHTS = ("w1", "w2", "w3")  # AutoEP's grouped expert tensors, as DeepSpeed names them in these files


def marker_for(path: str) -> dict | None:
    """What to write instead of an expert file's state dict (None: not an expert file)."""
    return {MARKER: True} if EXPERT_FILE.match(os.path.basename(str(path))) else None


@contextlib.contextmanager
def experts_from_module(checkpoint_engine, module: nn.Module) -> Iterator[None]:
    """While DeepSpeed's load_checkpoint runs: a marker file reads as the module's own experts, in the keys
    DeepSpeed's loader expects (`<block>.experts.w1.<global expert>`, one 2-D tensor each)."""
    original = checkpoint_engine.load
    blocks = [(name, m) for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)]  # its layer ids

    def load(path, *args, **kwargs):
        state = original(path, *args, **kwargs)
        if not (isinstance(state, dict) and state.get(MARKER)):
            return state
        layer, expert = map(int, EXPERT_FILE.match(os.path.basename(str(path))).groups())
        name, block = blocks[layer]
        local = expert - groups._get_expert_parallel_rank(block.ep_group_name) * block.num_local_experts
        prefix = f"{name}." if name else ""
        return {f"{prefix}experts.{w}.{expert}": getattr(block.experts, w)[local].detach().cpu().clone()
                for w in _WEIGHTS}

    checkpoint_engine.load = load
    try:
        yield
    finally:
        del checkpoint_engine.load  # the class's method again


def holds_frozen_experts(module: nn.Module) -> bool:
    """Whether AutoEP experts of this module are frozen (LoRA), so their files need not be written."""
    return any(isinstance(m, AutoEPMoELayer) and not any(p.requires_grad for p in (getattr(m.experts, w)
                                                                                  for w in _WEIGHTS))
               for m in module.modules())

