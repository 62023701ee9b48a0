"""The block-quantized FP8 layouts of DeepSeek-V3's and DeepSeek-V4's released weights.

A quantized 2-D weight `<name>` is stored as float8_e4m3fn with a float32 `<name>_scale_inv` beside it holding one
multiplier per block of `weight_block_size` (rows x columns, 128 x 128 as published; the last block of a dimension
that is not a multiple of it is partial): `w[i, j] = w_fp8[i, j] * scale_inv[i // rows, j // cols]`. config.json
declares the layout in `quantization_config` (`quant_method: fp8`). We train in a floating dtype, so the weights
are dequantized as they are read and the layout ends there: the model config built from such a directory, and
everything written from it (checkpoints, exports), carries no quantization_config.

DeepSeek-V4's (transformers' FineGrainedFP8Config `scale_fmt: ue8m0`, `expert_dtype: fp4`) stores the multipliers as
powers of two (float8_e8m0fnu, or its raw exponent bytes as uint8: 2 ** (byte - 127)) and its routed experts in
MXFP4: two e2m1 values per int8 byte (low nibble first) with one multiplier per 1 x 32 block. Both are dequantized as
transformers' Fp8Dequantize does (dequantize=True): in fp32, then cast, so the results are equal bit for bit.
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
FP4_DTYPES = (torch.int8,) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ())
QUANTIZED_DTYPES = FP8_DTYPES + FP4_DTYPES
FP4_BLOCK = (1, 32)  # MXFP4: 32 consecutive values of a row share a multiplier
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_FMTS, EXPERT_DTYPES = ("float", "ue8m0"), ("fp8", "fp4")
# The fields we act on; others (e.g. modules_to_not_convert) need nothing from us: whether a tensor is quantized
# is read from its own dtype and the presence of its scale. transformers' FP8 config has no `fmt` (e4m3 implied)
# and defaults activation_scheme to dynamic, so a config without them means these.
_FMT, _ACTIVATIONS = "e4m3", "dynamic"


class QuantizationError(UserError):
    """A quantization_config or quantized tensor we cannot dequantize."""


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """fp32 values of packed MXFP4 bytes: two e2m1 per byte, low nibble first (the last dimension doubles)."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    pairs = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@dataclass(frozen=True)
class BlockFP8:
    block: tuple[int, int]  # rows, columns
    scale_fmt: str = "float"  # "ue8m0": power-of-two multipliers (float8_e8m0fnu, or uint8 exponent bytes)

    def _scales(self, name: str, scale_inv: torch.Tensor) -> torch.Tensor:
        if scale_inv.dtype == torch.uint8 and self.scale_fmt == "ue8m0":  # E8M0 exponent bytes
            return (scale_inv.float() - 127.0).exp2()
        if not scale_inv.is_floating_point():
            raise QuantizationError(f"{name}{SCALE_SUFFIX} is {scale_inv.dtype}; scales are floating point "
                                    "(uint8 only as ue8m0 exponents, with quantization_config.scale_fmt: ue8m0)")
        return scale_inv.float()

    def dequantize(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`weight` (float8, or packed MXFP4) times its block's multiplier, computed in fp32, returned in `dtype`."""
        if weight.dtype not in QUANTIZED_DTYPES or weight.dim() != 2:
            raise QuantizationError(f"tensor {name} has a {name}{SCALE_SUFFIX} but is {weight.dtype} of shape "
                                    f"{tuple(weight.shape)}, not a 2-D float8_e4m3fn (or int8-packed MXFP4) weight")
        if weight.dtype in FP4_DTYPES:
            weight, (rows, cols) = unpack_fp4(weight), FP4_BLOCK
        else:
            rows, cols = self.block
        expected = (math.ceil(weight.shape[0] / rows), math.ceil(weight.shape[1] / cols))
        if tuple(scale_inv.shape) != expected:
            raise QuantizationError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; a {tuple(weight.shape)} "
                                    f"weight in {rows} x {cols} blocks needs {expected} (is weight_block_size right?)")
        scale = self._scales(name, scale_inv).repeat_interleave(rows, 0)[:weight.shape[0]]
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
    for key, allowed in (("scale_fmt", SCALE_FMTS), ("expert_dtype", EXPERT_DTYPES)):
        if q.get(key, allowed[0]) not in allowed:
            raise QuantizationError(f"{where}.{key} is {q[key]!r}; one of {', '.join(map(repr, allowed))} is read")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"{where}.weight_block_size is {block!r}; it must be [rows, columns], e.g. [128, 128]")
    return BlockFP8(tuple(block), q.get("scale_fmt", SCALE_FMTS[0]))


def read_quantization(hf_dir: str) -> BlockFP8 | None:
    """The FP8 layout of an HF directory's weights, from its config.json."""
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        return quantization_of(json.load(f), path)
