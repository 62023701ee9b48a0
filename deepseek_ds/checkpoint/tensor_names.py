"""DeepSpeed's names of a model's tensors, for each container, mapped to their HF names.

DeepSpeed names a parameter after the module that holds it, and our two containers name layers differently:
SequentialLM (pipeline_stages = 1) `layers.<i>.<key>`, DeepSeekPipelineModule `<i>.<key>` (a tied embedding
`tied_modules.embed.<key>`), with i the index in the same layer-spec list. The HF name of a tensor
(models.names.hf_name) depends on neither, so it is the key that both sides are mapped through.

With expert parallelism (parallel.expert_parallel > 1) DeepSpeed's AutoEP has replaced every MoE block `mlp`: its
router sits at `mlp.router` (the linear layer at `mlp.router.gate`) and its experts are grouped tensors `w1` (gate),
`w3` (up), `w2` (down), full size (all experts, in expert order) in a universal checkpoint. transformers fuses gate and
up into one `gate_up_proj` (E, 2I, H): w1 and w3 are its two halves along dim 1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from deepspeed.module_inject.auto_ep_presets.registry import get_preset
from deepspeed.pipe import TiedLayerSpec
from transformers import PretrainedConfig

from ..models.hf_io import load_hf_weights
from ..models.moe import autoep_preset
from ..models.names import hf_names
from ..models.pipeline import layer_specs
from ..models.tensor_parallel import split_dim
from .format import SEQUENTIAL, CheckpointError


class Entry(NamedTuple):
    """Where a DeepSpeed tensor goes in the HF checkpoint: all of `hf`, or with `part` = (i, n) the i-th of n equal
    blocks along dim 1 (AutoEP's w1 and w3 in the fused gate_up_proj)."""
    hf: str
    shape: torch.Size
    part: tuple[int, int] | None = None


_MLP = "layer.mlp."  # a decoder layer's MLP, dense or MoE, inside DecoderLayerPipe (and MTPLayerPipe)


def _autoep_names(config: PretrainedConfig) -> dict[str, list[tuple[str, tuple[int, int] | None]]]:
    """Key in transformers' MoE block -> [(key in AutoEP's, part)]. transformers' names come from DeepSpeed's AutoEP
    preset for the model; AutoEP's own (router, experts.w1/w2/w3) are fixed by its AutoEPMoELayer, which has no
    mapping back to the preset's, hence written out here."""
    p = get_preset(autoep_preset(config))
    if p.expert_storage != "fused_3d" or p.expert_w3 is not None:
        raise CheckpointError(f"AutoEP preset {config.model_type!r} does not store the experts as transformers' fused "
                              "gate_up_proj/down_proj, which is all this mapping knows; set parallel.expert_parallel = 1")
    router, experts = p.router_pattern, p.experts_pattern
    return {f"{router}.weight": [("router.gate.weight", None)],
            f"{router}.e_score_correction_bias": [("router.e_score_correction_bias", None)],
            f"{experts}.{p.expert_w1}": [("experts.w1", (0, 2)), ("experts.w3", (1, 2))],
            f"{experts}.{p.expert_w2}": [("experts.w2", None)]}


def _deepspeed_keys(key: str, shape: torch.Size, autoep: dict) -> list[tuple[str, torch.Size, tuple[int, int] | None]]:
    """The (key, shape, part) of the tensors that hold one layer tensor in the DeepSpeed module."""
    renamed = autoep.get(key.removeprefix(_MLP)) if key.startswith(_MLP) else None
    if not renamed:
        return [(key, shape, None)]
    return [(_MLP + new, shape if part is None else torch.Size([shape[0], shape[1] // part[1], *shape[2:]]), part)
            for new, part in renamed]


def container_entries(config: PretrainedConfig, scheme: str, autoep: bool = False) -> dict[str, Entry]:
    """DeepSpeed module name -> Entry of every parameter and persistent buffer, for one container, with or without
    AutoEP's MoE blocks. The layers are built on the meta device: no memory, whatever the model size."""
    renames = _autoep_names(config) if autoep else {}
    out = {}
    with torch.device("meta"):
        for i, spec in enumerate(layer_specs(config, seed=None)):
            tied = isinstance(spec, TiedLayerSpec)
            if tied and spec.forward_fn is not None:
                continue  # the tied head: its weight is the embedding's
            layer = spec.build()
            prefix = f"layers.{i}." if scheme == SEQUENTIAL else f"tied_modules.{spec.key}." if tied else f"{i}."
            shapes = {key: tensor.shape for key, tensor in layer.state_dict().items()}
            for key, hf in hf_names(layer).items():
                for ds_key, shape, part in _deepspeed_keys(key, shapes[key], renames):
                    out[prefix + ds_key] = Entry(hf, shape, part)
    return out


def layout_names(config: PretrainedConfig, scheme: str, autoep: bool = False) -> dict[str, str]:
    """DeepSpeed module name -> HF name of every parameter and persistent buffer, for one container."""
    return {name: entry.hf for name, entry in container_entries(config, scheme, autoep).items()}


def hf_tensors(weights: dict[str, torch.Tensor], entries: dict[str, Entry]) -> dict[str, torch.Tensor]:
    """DeepSpeed tensors by module name -> HF tensors; the parts of a fused tensor are concatenated in order (one with
    a part missing is left out, so reported missing)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    counts = {}
    for name, tensor in weights.items():
        if name in entries:
            entry = entries[name]
            index, counts[entry.hf] = entry.part or (0, 1)
            parts.setdefault(entry.hf, {})[index] = tensor.reshape(entry.shape)
    return {hf: torch.cat([p[i] for i in range(counts[hf])], dim=1) if counts[hf] > 1 else p[0]
            for hf, p in parts.items() if len(p) == counts[hf]}


def load_hf_weights_split(layers, hf_dir: str, config: PretrainedConfig, tensor_rank: int = 0,
                          tensor_size: int = 1) -> int:
    """models.hf_io.load_hf_weights for local layers that AutoEP and AutoTP have split (ZeRO 0-2): a split layer is
    read into a fresh whole copy of itself, one layer at a time, then copied across: AutoEP's tensors by
    _autoep_names, each rank taking its own experts' rows of the grouped tensors (AutoEP places experts uniformly:
    rank r holds experts r*E/ep .. (r+1)*E/ep-1), and each AutoTP shard its rank's block along models.tensor_parallel's
    split_dim. Returns the bytes read."""
    layers = list(layers)
    autoep = any(isinstance(m, AutoEPMoELayer) for layer in layers for m in layer.modules())
    if not autoep and tensor_size == 1:
        return load_hf_weights(layers, hf_dir, config)
    to_hf = {new: (key, part) for key, renamed in _autoep_names(config).items() for new, part in renamed} \
        if autoep else {}
    read = 0
    for layer in layers:
        moe = next((m for m in layer.modules() if isinstance(m, AutoEPMoELayer)), None)
        if moe is None and tensor_size == 1:
            read += load_hf_weights([layer], hf_dir, config)
            continue
        with torch.device("meta"):
            fresh = type(layer)(config, *([layer.layer_idx] if hasattr(layer, "layer_idx") else []))
        fresh.to_empty(device="cpu")
        read += load_hf_weights([fresh], hf_dir, config)
        source = fresh.state_dict()
        with torch.no_grad():
            for key, target in layer.state_dict(keep_vars=True).items():
                inner = key.removeprefix(_MLP) if key.startswith(_MLP) else None
                hf_key, part = to_hf.get(inner, (None, None))
                whole = key if hf_key is None else _MLP + hf_key
                value = source[whole]
                if moe is not None and inner is not None and inner.startswith("experts."):
                    first = moe.ep_rank * moe.num_local_experts
                    value = value[first:first + moe.num_local_experts]
                if part is not None:
                    value = value.chunk(part[1], dim=1)[part[0]]
                if value.shape != target.shape and tensor_size > 1:
                    value = value.chunk(tensor_size, dim=split_dim(whole, config.model_type))[tensor_rank]
                if value.shape != target.shape:
                    raise CheckpointError(f"{hf_dir}: {key} is {tuple(value.shape)} for this rank, the model's is "
                                          f"{tuple(target.shape)}")
                target.data.copy_(value)
    return read
