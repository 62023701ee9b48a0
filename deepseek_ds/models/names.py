"""THE map between our pipeline layers' tensor names and Hugging Face names.

Our layers hold transformers' own modules under fixed attribute names, so below those attributes a tensor is named as
in transformers; the map is literal down to there (in the manner of torchtitan's `from_hf_map`). `{i}` is the decoder
layer's index (`layer_idx`); a prefix mapped to None names tensors that checkpoints do not store (the rotary tables,
rebuilt from the config). Every reader and writer of HF names (hf_io, the checkpoint's DeepSpeed names, export) goes
through `hf_name`.

In memory, transformers fuses the routed experts into 3-D tensors (`mlp.experts.gate_up_proj` (E, 2I, H),
`mlp.experts.down_proj` (E, H, I)); the published checkpoints store one tensor per expert and projection
(`mlp.experts.<e>.gate_proj.weight`, ...). FUSED_EXPERTS is that map; split_experts / fuse_experts apply it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .layers import DecoderLayerPipe, EmbeddingPipe, FinalNormPipe, LMHeadPipe, MTPLayerPipe, mtp_depth
from .registry import family_of

_DECODER = "model.layers.{i}."
_HC_HEAD = "model.hc_head."  # DeepSeek-V4's hyper-connection head, on the stage with the final norm

# Layer type -> ((prefix of our key, prefix of the HF name or None), ...); the first matching prefix wins.
TO_HF: dict[type, tuple[tuple[str, str | None], ...]] = {
    EmbeddingPipe: (("embed_tokens.", "model.embed_tokens."),),
    DecoderLayerPipe: (("layer.", _DECODER), ("rotary.", None)),
    MTPLayerPipe: (("layer.", _DECODER), ("rotary.", None), ("enorm.", _DECODER + "enorm."),
                   ("hnorm.", _DECODER + "hnorm."), ("eh_proj.", _DECODER + "eh_proj."),
                   ("shared_head.norm.", _DECODER + "shared_head.norm.")),
    FinalNormPipe: (("norm.", "model.norm."), ("hc_head.", _HC_HEAD)),
    LMHeadPipe: (("lm_head.", "lm_head."),),
}
# The published MTP modules' own copies of the shared embedding and head (below the module's prefix); transformers'
# MtpModel skips them, our MTP layers share the main model's.
MTP_EMBED, MTP_HEAD = "embed_tokens.weight", "shared_head.head.weight"
# Fused expert tensor -> the per-expert projections it holds, in order along dim 1.
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_EXPERTS = "mlp.experts"


def hf_name(layer: nn.Module, key: str) -> str | None:
    """The HF checkpoint name of tensor `key` of one pipeline layer; None for tensors checkpoints do not store."""
    for ours, hf in TO_HF[type(layer)]:
        if key.startswith(ours):
            return None if hf is None else hf.format(i=getattr(layer, "layer_idx", None)) + key[len(ours):]
    raise KeyError(f"{type(layer).__name__} tensor {key!r} has no HF name: add its prefix to models/names.py TO_HF")


def hf_names(layer: nn.Module) -> dict[str, str]:
    """Our key -> HF name of every tensor of one layer that checkpoints store."""
    names = {key: hf_name(layer, key) for key in layer.state_dict()}
    return {key: name for key, name in names.items() if name is not None}


def hf_state_dict(layers, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """HF (in-memory, fused-expert) names -> tensors of an iterable of pipeline layers; persistent buffers such as
    the router's e_score_correction_bias included. keep_vars: the parameters themselves (to fill them in place)."""
    out = {}
    for layer in layers:
        state = layer.state_dict(keep_vars=keep_vars)
        out.update({name: state[key] for key, name in hf_names(layer).items()})
    return out


def hf_layer_prefix(layer: DecoderLayerPipe) -> str:
    """The HF name prefix of every tensor of one decoder (or MTP) layer."""
    return _DECODER.format(i=layer.layer_idx)


def hf_prefix(layer: nn.Module) -> str:
    """The HF name prefix of every tensor one pipeline layer owns in a checkpoint (its first TO_HF entry's)."""
    return TO_HF[type(layer)][0][1].format(i=getattr(layer, "layer_idx", None))


def model_hf_prefixes(config) -> set[str]:
    """hf_prefix of every layer of the whole model (all pipeline stages), from its config."""
    layers = config.num_hidden_layers + mtp_depth(config)
    top = {"model.embed_tokens.", "model.norm."} | ({"lm_head."} if not getattr(config, "tie_word_embeddings", False)
                                                     else set())
    top |= {_HC_HEAD} if family_of(config).streams_head else set()
    return top | {_DECODER.format(i=i) for i in range(layers)}


_LAYER_PREFIX = re.compile(r"(model\.layers\.\d+\.|model\.embed_tokens\.|model\.norm\.|model\.hc_head\.|lm_head\.)")


def owner_prefix(name: str) -> str | None:
    """The hf_prefix a checkpoint tensor name falls under (the layer it would belong to), None for any other name."""
    m = _LAYER_PREFIX.match(name)
    return m.group(0) if m else None


def _fused(name: str) -> tuple[str, tuple[str, ...]] | None:
    prefix, leaf = name.rsplit(".", 1)
    return (prefix, FUSED_EXPERTS[leaf]) if prefix.endswith(_EXPERTS) and leaf in FUSED_EXPERTS else None


def per_expert_names(name: str, num_experts: int) -> list[str] | None:
    """The published checkpoints' tensors that make up fused tensor `name`, in the order fuse_experts takes them
    (expert by expert); None when `name` is not a fused expert tensor."""
    fused = _fused(name)
    if fused is None:
        return None
    prefix, projs = fused
    return [f"{prefix}.{e}.{p}.weight" for e in range(num_experts) for p in projs]


def split_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused expert tensor as the published per-expert tensors (views); any other tensor as itself."""
    fused = _fused(name)
    if fused is None:
        return {name: tensor}
    prefix, projs = fused
    size = tensor.shape[1] // len(projs)
    return {f"{prefix}.{e}.{p}.weight": tensor[e, j * size:(j + 1) * size]
            for e in range(tensor.shape[0]) for j, p in enumerate(projs)}


def fuse_experts(name: str, parts: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Fused tensor `name` from its per-expert tensors, in per_expert_names order."""
    n = len(_fused(name)[1])
    return torch.stack([torch.cat(parts[n * e:n * (e + 1)], dim=0) for e in range(num_experts)])
