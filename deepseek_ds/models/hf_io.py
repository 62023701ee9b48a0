"""Between our pipeline layers and Hugging Face models / directories.

In memory our tensors carry transformers' own (fused-expert) layout, so the mapping is only a renaming (names.py);
transformers' save_pretrained / from_pretrained convert between that layout and the per-expert tensors of
the published checkpoints.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

from .layers import EmbeddingPipe, LMHeadPipe, MTPLayerPipe, family_of
from .names import MTP_EMBED, MTP_HEAD, fuse_experts, hf_layer_prefix, hf_state_dict, per_expert_names, split_experts


def to_hf_model(layers, config) -> nn.Module:
    """A transformers CausalLM holding (sharing) the weights of the given layers (MTP modules aside: transformers'
    CausalLM has none; mtp_hf_state_dict gives their tensors)."""
    sd = hf_state_dict(l for l in layers if not isinstance(l, MTPLayerPipe))
    if getattr(config, "tie_word_embeddings", False):
        sd["lm_head.weight"] = next(l for l in layers if isinstance(l, EmbeddingPipe)).embed_tokens.weight
    with torch.device("meta"):
        model = family_of(config).causal_lm(config)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise KeyError(f"weights do not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # Non-persistent buffers (rotary tables) were left on meta: rebuild them on the CPU.
    for module in model.modules():
        if hasattr(module, "inv_freq") and module.inv_freq.device.type == "meta":
            fresh = type(module)(config)
            module.inv_freq = fresh.inv_freq
            module.original_inv_freq = fresh.original_inv_freq
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def mtp_hf_state_dict(layers, config) -> dict[str, torch.Tensor]:
    """The MTP modules' tensors in the published DeepSeek-V3 layout: `model.layers.{num_hidden_layers + k - 1}.*`,
    experts one tensor per expert and projection, and each module's copy of the shared embedding and head
    (`embed_tokens`, `shared_head.head`), which the published checkpoints store and transformers' MtpModel skips.
    save_pretrained converts only what the CausalLM holds, so this split of the fused experts is ours."""
    layers = list(layers)
    mtp = [l for l in layers if isinstance(l, MTPLayerPipe)]
    if not mtp:
        return {}
    embed = next(l for l in layers if isinstance(l, EmbeddingPipe)).embed_tokens.weight
    head = next((l.lm_head.weight for l in layers if isinstance(l, LMHeadPipe)), embed)
    out = {}
    for name, tensor in hf_state_dict(mtp).items():
        out.update(split_experts(name, tensor))
    for layer in mtp:
        out[hf_layer_prefix(layer) + MTP_EMBED] = embed
        out[hf_layer_prefix(layer) + MTP_HEAD] = head
    # Copies: safetensors refuses tensors that share memory (expert slices, the embedding used by every depth).
    return {k: v.detach().clone() for k, v in out.items()}


# -------------------------------------------------------------------------------------------- reading a directory
def _weight_map(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> file, from the sharded index or the single model.safetensors."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(hf_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{hf_dir} has neither model.safetensors.index.json nor model.safetensors")
    with safe_open(single, "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _disk_names(wanted: str, weight_map: dict[str, str], num_experts: int) -> list[str]:
    """On-disk tensors that make up one in-memory tensor: itself, or the published checkpoints' per-expert tensors
    of a fused one (transformers converts only whole models on load; this is per tensor, for stage-local loading)."""
    if wanted in weight_map:
        return [wanted]
    names = per_expert_names(wanted, num_experts)
    if names is None:
        raise KeyError(f"tensor {wanted!r} is not in the checkpoint")
    return names


def load_hf_weights(layers, hf_dir: str, num_experts: int = 0) -> int:
    """Fill the given (local) pipeline layers from an HF safetensors directory, reading only their own
    tensors. Returns the number of bytes read, so callers and tests can see a stage reads only its share."""
    weight_map = _weight_map(hf_dir)
    wanted = hf_state_dict(layers, keep_vars=True)  # hf name -> destination tensor
    plan = {name: _disk_names(name, weight_map, num_experts) for name in wanted}
    by_file: dict[str, set[str]] = {}
    for names in plan.values():
        for n in names:
            by_file.setdefault(weight_map[n], set()).add(n)
    loaded: dict[str, torch.Tensor] = {}
    read = 0
    for fname, names in sorted(by_file.items()):
        with safe_open(os.path.join(hf_dir, fname), "pt") as f:
            for n in sorted(names):
                loaded[n] = f.get_tensor(n)
                read += loaded[n].numel() * loaded[n].element_size()
    with torch.no_grad():
        for name, dest in wanted.items():
            parts = [loaded[n] for n in plan[name]]
            src = parts[0] if plan[name] == [name] else fuse_experts(name, parts, num_experts)
            if src.shape != dest.shape:
                raise ValueError(f"{hf_dir}: tensor {name} has shape {tuple(src.shape)}, the model expects "
                                 f"{tuple(dest.shape)}; is config.json the one these weights were saved with?")
            dest.copy_(src.to(dest.dtype))
    return read


def mtp_layers_absent(layers, hf_dir: str) -> tuple[list, list]:
    """(the layers to load, the MTP modules the directory has no tensors for)."""
    names = _weight_map(hf_dir)
    absent = [l for l in layers
              if isinstance(l, MTPLayerPipe) and not any(n.startswith(hf_layer_prefix(l)) for n in names)]
    return [l for l in layers if l not in absent], absent


def has_weights(hf_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(hf_dir, f)) for f in ("model.safetensors.index.json", "model.safetensors"))


def pickled_weights(hf_dir: str) -> list[str]:
    """The PyTorch-pickle weight files (pytorch_model*.bin) of a directory. We read safetensors only (no unpickling
    of a downloaded file), so a directory with just these must be refused, not trained from random weights."""
    return sorted(f for f in os.listdir(hf_dir) if f.startswith("pytorch_model") and
                  (f.endswith(".bin") or f.endswith(".bin.index.json")))
