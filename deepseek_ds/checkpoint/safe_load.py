"""Reading checkpoint files without running pickled code."""

from __future__ import annotations

import contextlib
import os

import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

_trusted_depth = 0  # open trusted_types_only() contexts in this process


@contextlib.contextmanager
def trusted_types_only():
    """Inside, every torch.load runs the weights-only unpickler, DeepSpeed's own included: DeepSpeed loads its
    checkpoint files with weights_only=False (engine.load_checkpoint, ds_to_universal, zero_to_fp32), which
    would run any pickled code in a tampered file. TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides that per call;
    besides tensors and containers only three plain DeepSpeed data types found in its files are allowed."""
    global _trusted_depth
    if _trusted_depth:  # nested: leaving torch's safe_globals would drop the outer one's allowlist too
        yield
        return
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(key)
    os.environ[key] = "1"
    _trusted_depth += 1
    try:
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            yield
    finally:
        _trusted_depth -= 1
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
