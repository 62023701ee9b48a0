"""Between our pipeline layers and Hugging Face models / directories.

In memory our tensors carry transformers' own (fused-expert) layout, so the mapping is only a renaming (names.py);
transformers' save_pretrained / from_pretrained convert between that layout and the per-expert tensors of
the published checkpoints.
"""

from __future__ import annotations

import json
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import is_zero_param
from peft import inject_adapter_in_model
from safetensors import safe_open
from torch import nn

from ..utils.errors import UserError
from .checkpoint_names import CheckpointNames
from .fp8 import QUANTIZED_DTYPES, SCALE_SUFFIX, BlockFP8, QuantizationError, read_quantization
from .layers import EmbeddingPipe, LMHeadPipe, MTPLayerPipe, family_of
from .lora import ADAPTER, lora_config
from .names import (
    MTP_EMBED,
    MTP_HEAD,
    fuse_experts,
    hf_layer_prefix,
    hf_prefix,
    hf_state_dict,
    model_hf_prefixes,
    owner_prefix,
    per_expert_names,
    split_experts,
)
from .presets import num_routed_experts


def to_hf_model(layers, config, lora=None) -> nn.Module:
    """A transformers CausalLM holding (sharing) the weights of the given layers (MTP modules aside: transformers'
    CausalLM has none; mtp_hf_state_dict gives their tensors). lora: the run's lora section when the layers carry
    peft adapters (lora.r > 0); peft injects the same ones into the CausalLM, which then shares them too."""
    sd = hf_state_dict(l for l in layers if not isinstance(l, MTPLayerPipe))
    if getattr(config, "tie_word_embeddings", False):
        sd["lm_head.weight"] = next(l for l in layers if isinstance(l, EmbeddingPipe)).embed_tokens.weight
    with torch.device("meta"):
        model = family_of(config).causal_lm(config)
        if lora is not None and lora.r:
            inject_adapter_in_model(lora_config(lora, config), model, adapter_name=ADAPTER)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise KeyError(f"weights do not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # Non-persistent buffers (rotary tables: inv_freq, or DeepSeek-V4's main_/compress_inv_freq) were left on meta:
    # rebuild them on the CPU.
    for module in model.modules():
        stale = [n for n, b in module.named_buffers(recurse=False) if n.endswith("inv_freq") and b.device.type == "meta"]
        if stale:
            fresh = type(module)(config)
            for name in stale:
                setattr(module, name, getattr(fresh, name))
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
class WeightsMismatchError(UserError):
    """A weights directory whose tensors are not this model's, one for one."""


INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
# Rotary tables some older transformers versions saved; ours are rebuilt from the config.
_ROTARY_TABLE = "rotary_emb.inv_freq"


def _weights_file(hf_dir: str) -> str:
    for name in (INDEX, SINGLE):
        if os.path.isfile(os.path.join(hf_dir, name)):
            return name
    raise FileNotFoundError(f"{hf_dir} has neither {INDEX} nor {SINGLE}")


def _weight_map(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> file, from the sharded index or the single model.safetensors."""
    if _weights_file(hf_dir) == INDEX:
        with open(os.path.join(hf_dir, INDEX)) as f:
            return json.load(f)["weight_map"]
    with safe_open(os.path.join(hf_dir, SINGLE), "pt") as f:
        return {k: SINGLE for k in f.keys()}


def _disk_names(wanted: str, weight_map: dict[str, str], num_experts: int) -> list[str]:
    """On-disk tensors that make up one in-memory tensor: itself, or the published checkpoints' per-expert tensors
    of a fused one (transformers converts only whole models on load; this is per tensor, for stage-local loading)."""
    if wanted in weight_map:
        return [wanted]
    return per_expert_names(wanted, num_experts) or [wanted]


def _listed(names: list[str], where=None) -> str:
    shown = ", ".join(f"{n} ({where[n]})" if where else n for n in names[:3])
    return f"{len(names)}: {shown}{', ...' if len(names) > 3 else ''}"


def _unused_mtp_module(owner: str | None, weight_map: dict[str, str], config) -> bool:
    """Whether `owner` is a published MTP module beyond the model's num_nextn_predict_layers (V3 ships one; a model
    configured with fewer trains without it, as transformers' DeepseekV3ForCausalLM ignores model.layers.61.*)."""
    index = owner.removeprefix("model.layers.").rstrip(".") if owner and owner.startswith("model.layers.") else ""
    return (index.isdigit() and int(index) >= config.num_hidden_layers
            and owner + "eh_proj.weight" in weight_map)


def _check_one_for_one(plan: dict[str, list[str]], layers, weight_map: dict[str, str], hf_dir: str, config,
                       scales: bool, renamed: CheckpointNames | None) -> None:
    """Every tensor of this rank's layers on disk feeds a parameter and every parameter has its tensors; a tensor
    that belongs to no layer of any stage is refused on every rank. Tensors of other stages' layers are theirs.
    renamed: the directory's names resolved to in-memory ones, for families whose checkpoints rename them."""
    missing = sorted(n for names in plan.values() for n in names if n not in weight_map)
    if missing:
        raise WeightsMismatchError(f"{hf_dir}: parameters of this {config.model_type} model with no tensor in "
                                   f"{_weights_file(hf_dir)}, {_listed(missing)}; is config.json the one these "
                                   "weights were saved with?")
    consumed = {n for names in plan.values() for n in names}
    if scales:
        consumed |= {n + SCALE_SUFFIX for n in consumed}
    local = {hf_prefix(layer) for layer in layers}
    # The published MTP modules' own copies of the shared embedding and head: ours share the main model's.
    copies = {hf_prefix(layer) + key for layer in layers if isinstance(layer, MTPLayerPipe) for key in (MTP_EMBED, MTP_HEAD)}
    whole_model = model_hf_prefixes(config)
    unmapped = []
    for name in sorted(set(weight_map) - consumed - copies):
        if renamed is not None and renamed.ignored(name):
            continue
        owner = owner_prefix(renamed.in_memory(name) if renamed is not None else name)
        if name.endswith(_ROTARY_TABLE) or (owner in whole_model and owner not in local):
            continue
        if owner in local or not _unused_mtp_module(owner, weight_map, config):
            unmapped.append(name)
    if unmapped:
        hint = (f"{SCALE_SUFFIX} tensors are FP8 scales, but config.json has no quantization_config"
                if not scales and any(n.endswith(SCALE_SUFFIX) for n in unmapped)
                else "is config.json the one these weights were saved with?")
        raise WeightsMismatchError(f"{hf_dir}: tensors that map to no parameter of this {config.model_type} model, "
                                   f"{_listed(unmapped, weight_map)}; {hint}")


def _dequantized(name: str, raw: dict[str, torch.Tensor], fp8: BlockFP8 | None, dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` as read, or dequantized with its scale when it is stored in FP8 (each read tensor used once)."""
    tensor, scale = raw.pop(name), raw.pop(name + SCALE_SUFFIX, None)
    if scale is not None:
        return fp8.dequantize(name, tensor, scale, dtype)
    if tensor.dtype in QUANTIZED_DTYPES:
        raise QuantizationError(f"tensor {name} is stored as {tensor.dtype} without its {name}{SCALE_SUFFIX}; "
                                "casting it without its scales would give wrong weights")
    return tensor


def load_hf_weights(layers, hf_dir: str, config) -> int:
    """Fill the given (local) pipeline layers of a model with this config from an HF safetensors directory, reading
    only their own tensors; FP8 weights (fp8.py) are dequantized into the parameters' dtype. A tensor or parameter
    without its counterpart is refused (_check_one_for_one). Returns the number of bytes read, so callers and tests
    can see a stage reads only its share.

    Parameters partitioned by deepspeed.zero.Init (ZeRO-3) are gathered one layer at a time: rank 0 reads and fills
    that layer, and leaving the gather partitions it over the ranks again, so no rank ever holds more than its share
    plus one layer. Buffers (the V3 router's e_score_correction_bias) are not partitioned: rank 0 broadcasts them.
    A mismatch rank 0 finds is raised on every rank, after the gathers, so no rank is left waiting in one."""
    layers = list(layers)
    if not any(is_zero_param(p) for layer in layers for p in layer.parameters()):
        return _load_layers(layers, hf_dir, config, _Directory(hf_dir, config))
    read, error, directory = 0, None, None
    device = get_accelerator().current_device_name()
    for layer in layers:
        with deepspeed.zero.GatheredParameters(list(layer.parameters()), modifier_rank=0):
            if dist.get_rank() == 0 and error is None:
                try:
                    directory = directory or _Directory(hf_dir, config)
                    read += _load_layers([layer], hf_dir, config, directory)
                except UserError as e:  # raised below on every rank
                    error = e
        for buffer in layer.buffers():
            sent = buffer.data.to(device)
            dist.broadcast(sent, 0)
            buffer.data.copy_(sent)
    found = [str(error) if error else None]
    dist.broadcast_object_list(found, 0)
    if error is not None:
        raise error
    if found[0] is not None:
        raise WeightsMismatchError(found[0])
    return read


class _Directory:
    """What loading needs of a directory's index, read once per load (ZeRO-3 loads layer by layer): its tensors'
    files, FP8 layout, and for families whose checkpoints rename tensors, their names resolved (CheckpointNames)."""

    def __init__(self, hf_dir: str, config):
        self.weight_map = _weight_map(hf_dir)
        self.fp8 = read_quantization(hf_dir)
        family = family_of(config)
        self.renamed = (CheckpointNames(family.causal_lm, config, self.weight_map, quantized=self.fp8 is not None)
                        if family.renamed_on_disk else None)
        if self.renamed is not None:
            self.weight_map = self.renamed.weight_map


def _load_layers(layers: list, hf_dir: str, config, directory: _Directory) -> int:
    weight_map, fp8, renamed = directory.weight_map, directory.fp8, directory.renamed
    wanted = hf_state_dict(layers, keep_vars=True)  # hf name -> destination tensor
    if renamed is not None:
        plan = {name: renamed.sources(name) for name in wanted}
    else:
        plan = {name: _disk_names(name, weight_map, num_routed_experts(config)) for name in wanted}
    _check_one_for_one(plan, layers, weight_map, hf_dir, config, fp8 is not None, renamed)
    reads = {n for names in plan.values() for n in names}
    reads |= {n + SCALE_SUFFIX for n in reads if fp8 and n + SCALE_SUFFIX in weight_map}
    by_file: dict[str, list[str]] = {}
    for n in reads:
        by_file.setdefault(weight_map[n], []).append(n)
    raw: dict[str, torch.Tensor] = {}
    read = 0
    for fname, names in sorted(by_file.items()):
        with safe_open(os.path.join(hf_dir, fname), "pt") as f:
            for n in sorted(names):
                raw[n] = f.get_tensor(renamed.on_disk(n) if renamed is not None else n)
                read += raw[n].numel() * raw[n].element_size()
    with torch.no_grad():
        for name, dest in wanted.items():
            parts = [_dequantized(n, raw, fp8, dest.dtype) for n in plan[name]]
            if renamed is not None:
                src = renamed.assemble(name, parts)
            else:
                src = parts[0] if plan[name] == [name] else fuse_experts(name, parts, num_routed_experts(config))
            if src.shape != dest.shape:
                raise WeightsMismatchError(f"{hf_dir}: tensor {name} has shape {tuple(src.shape)}, the model "
                                           f"expects {tuple(dest.shape)}; is config.json the one these weights "
                                           "were saved with?")
            dest.copy_(src.to(dest.dtype))
    return read


def mtp_layers_absent(layers, hf_dir: str) -> tuple[list, list]:
    """(the layers to load, the MTP modules the directory has no tensors for)."""
    names = _weight_map(hf_dir)
    absent = [l for l in layers
              if isinstance(l, MTPLayerPipe) and not any(n.startswith(hf_layer_prefix(l)) for n in names)]
    return [l for l in layers if l not in absent], absent


def has_weights(hf_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(hf_dir, f)) for f in (INDEX, SINGLE))


def pickled_weights(hf_dir: str) -> list[str]:
    """The PyTorch-pickle weight files (pytorch_model*.bin) of a directory. We read safetensors only (no unpickling
    of a downloaded file), so a directory with just these must be refused, not trained from random weights."""
    return sorted(f for f in os.listdir(hf_dir) if f.startswith("pytorch_model") and
                  (f.endswith(".bin") or f.endswith(".bin.index.json")))
