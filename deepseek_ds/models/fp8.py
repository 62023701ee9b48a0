"""The block-quantized FP8 layout of DeepSeek-V3's released weights.

A quantized 2-D weight `<name>` is stored as float8_e4m3fn with a float32 `<name>_scale_inv` beside it holding one
multiplier per block of `weight_block_size` (rows x columns, 128 x 128 as published; the last block of a dimension
that is not a multiple of it is partial): `w[i, j] = w_fp8[i, j] * scale_inv[i // rows, j // cols]`. config.json
declares the layout in `quantization_config` (`quant_method: fp8`). We train in a floating dtype, so the weights
are dequantized as they are read and the layout ends there: the model config built from such a directory, and
everything written from it (checkpoints, exports), carries no quantization_config.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from ..utils.errors import UserError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
# The fields we act on; others (e.g. modules_to_not_convert) need nothing from us: whether a tensor is quantized
# is read from its own dtype and the presence of its scale. transformers' FP8 config has no `fmt` (e4m3 implied)
# and defaults activation_scheme to dynamic, so a config without them means these.
_FMT, _ACTIVATIONS = "e4m3", "dynamic"


class QuantizationError(UserError):
    """A quantization_config or quantized tensor we cannot dequantize."""


@dataclass(frozen=True)
class BlockFP8:
    block: tuple[int, int]  # rows, columns

    def dequantize(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`weight` (float8) times its block's multiplier, computed in fp32 and returned in `dtype`."""
        if weight.dtype not in FP8_DTYPES or weight.dim() != 2:
            raise QuantizationError(f"tensor {name} has a {name}{SCALE_SUFFIX} but is {weight.dtype} of shape "
                                    f"{tuple(weight.shape)}, not a 2-D float8_e4m3fn weight")
        rows, cols = self.block
        expected = (math.ceil(weight.shape[0] / rows), math.ceil(weight.shape[1] / cols))
        if tuple(scale_inv.shape) != expected:
            raise QuantizationError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; a {tuple(weight.shape)} "
                                    f"weight in {rows} x {cols} blocks needs {expected} (is weight_block_size right?)")
        scale = scale_inv.float().repeat_interleave(rows, 0)[:weight.shape[0]]
        scale = scale.repeat_interleave(cols, 1)[:, :weight.shape[1]]
        return (weight.float() * scale).to(dtype)


def quantization_of(raw_config: dict, source: str) -> BlockFP8 | None:
    """The FP8 layout a config.json (as a dict) declares; None when it declares no quantization."""
    q = raw_config.get("quantization_config")
    if q is None:
        return None
    where = f"{source}: quantization_config"
    if q.get("quant_method") != "fp8":
        raise QuantizationError(f"{where}.quant_method is {q.get('quant_method')!r}; only DeepSeek's block FP8 "
                                "('fp8') is read: dequantize the weights to bf16/fp32 first")
    if q.get("fmt", _FMT) != _FMT:
        raise QuantizationError(f"{where}.fmt is {q['fmt']!r}; only {_FMT!r} (float8_e4m3fn weights) is read")
    if q.get("activation_scheme", _ACTIVATIONS) != _ACTIVATIONS:
        raise QuantizationError(f"{where}.activation_scheme is {q['activation_scheme']!r}; only {_ACTIVATIONS!r} "
                                "(no stored activation scales) is read")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"{where}.weight_block_size is {block!r}; it must be [rows, columns], e.g. [128, 128]")
    return BlockFP8(tuple(block))


def read_quantization(hf_dir: str) -> BlockFP8 | None:
    """The FP8 layout of an HF directory's weights, from its config.json."""
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        return quantization_of(json.load(f), path)
