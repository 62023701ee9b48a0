"""THE reader of a checkpoint's weights: the fp32 weights (the optimizer's master copies for ZeRO >= 1) and
persistent buffers of a checkpoint, whatever ZeRO stage, pipeline, expert- or tensor-parallel layout wrote it, by
HF name (what export writes) or by a container's names (what eval loads into SequentialLM)."""

from __future__ import annotations

import glob
import os
import re

import torch
from deepspeed.checkpoint.autoep_universal import resolve_expert_ckpt_path
from deepspeed.pipe import TiedLayerSpec
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from transformers import PretrainedConfig

from ..models.names import hf_name
from ..models.pipeline import layer_specs
from ..models.tensor_parallel import split_dim
from ..parallel.degrees import Layout
from .format import CheckpointError, read_meta, saved_layout
from .safe_load import trusted_types_only
from .state import read_buffers, read_expert_adapters
from .tensor_names import container_entries, hf_tensors, layout_names
from .universal import cached_universal

_LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")  # DeepSpeed's per-layer files of a pipeline
_AUTOEP_ADAPTER = re.compile(r"\.experts\.lora_[AB]_")  # parallel/expert_lora.py's parameters


def read_weights(tag_dir: str, config: PretrainedConfig, work_dir: str, scheme: str | None = None
                 ) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's model by HF name, or with `scheme` (SEQUENTIAL, PIPELINE) by the names of
    that container without AutoEP (SEQUENTIAL: SequentialLM's state dict). ZeRO >= 1 is read through a universal
    conversion, cached beside the checkpoint (universal.cached_universal; `work_dir` if that is read-only)."""
    saved = saved_layout(read_meta(tag_dir))
    with trusted_types_only():
        if saved.tensor_parallel > 1:
            source, weights = saved.scheme, _tensor_parallel_weights(tag_dir, saved, config)
        elif saved.zero_stage == 0:
            source, weights = saved.scheme, _zero0_weights(tag_dir, saved, config)
        else:
            source, weights = _universal_weights(tag_dir, saved, config, work_dir)
    entries = container_entries(config, source, saved.autoep)
    out = hf_tensors(weights, entries)
    out.update(read_buffers(tag_dir))
    missing = {entry.hf for entry in entries.values()} - set(out)
    if missing and saved.zero_stage > 0 and saved.tensor_parallel == 1:
        out.update({n: t for n, t in _frozen_weights(tag_dir, saved, config).items() if n in missing})
    missing = sorted({entry.hf for entry in entries.values()} - set(out))
    if missing:
        raise CheckpointError(f"{tag_dir} lacks {len(missing)} tensors of its model, e.g. {missing[:3]}; the "
                              "checkpoint is incomplete or from another model config")
    if scheme is None:
        return out
    return {name: out[hf] for name, hf in layout_names(config, scheme).items()}


def _frozen_weights(tag_dir: str, saved: Layout, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The model's parameters by HF name as DeepSpeed saved them beside its optimizer states: a pipeline's per-layer
    files, ZeRO-2/3's fragments (zero_to_fp32 gathers them, frozen ones too), ZeRO-1's module. The caller takes the
    frozen ones from it (e.g. DeepSeek-V4's and V3.2's lightning indexers, or all but V3.2's indexers in its warm-up),
    which a universal conversion leaves out: it is made of optimizer states, and they have none."""
    with torch.device("meta"):
        layers = [spec.build() for spec in layer_specs(config, seed=None)]
    frozen = {f"layers.{i}.{key}": hf_name(layer, key) for i, layer in enumerate(layers)
              for key, _ in layer.named_parameters()}
    if saved.pipeline_stages > 1:
        container = {f"layers.{i}.{k}": v for i, state in _pipeline_layer_files(tag_dir) for k, v in state.items()}
    elif saved.zero_stage >= 2:
        container = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(tag_dir), os.path.basename(tag_dir))
    else:
        container = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu",
                               weights_only=True)["module"]
    return {hf: container[key].float() for key, hf in frozen.items() if key in container}


def _universal_weights(tag_dir: str, saved: Layout, config: PretrainedConfig, work_dir: str
                       ) -> tuple[str, dict[str, torch.Tensor]]:
    """(the scheme its names follow, the fp32 tensors of a universal conversion by DeepSpeed name)."""
    scheme, uni = cached_universal(tag_dir, saved.scheme, config, work_dir)
    weights = {}
    zero = os.path.join(uni, "zero")
    for name in os.listdir(zero):
        path = os.path.join(zero, name, "fp32.pt")
        if os.path.isfile(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
            # ZeRO-1/2 conversions store {"param": tensor, ...}, ZeRO-3's the bare, flat tensor.
            weights[name] = state["param"] if isinstance(state, dict) else state
    return scheme, weights


def _zero0_weights(tag_dir: str, saved: Layout, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """ZeRO-0 keeps the model's own (full) weights in its model-states files: per layer for a pipeline, where a
    tied layer's file (named after its first use) holds what the module calls `tied_modules.<key>`; AutoEP's experts
    are in files of their own."""
    out = _autoep_expert_files(tag_dir) if saved.autoep else {}
    if saved.pipeline_stages == 1:
        states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=True)
        out.update(states["module"])
        return out
    specs = layer_specs(config, seed=None)
    for i, layer in _pipeline_layer_files(tag_dir):
        prefix = f"tied_modules.{specs[i].key}." if isinstance(specs[i], TiedLayerSpec) else f"{i}."
        out.update({prefix + k: v for k, v in layer.items()})
    return out


def _pipeline_layer_files(tag_dir: str):
    """(layer index, its state dict) of each per-layer model-states file a pipeline run wrote."""
    for name in sorted(os.listdir(tag_dir)):
        m = _LAYER_FILE.match(name)
        if m:
            yield int(m.group(1)), torch.load(os.path.join(tag_dir, name), map_location="cpu", weights_only=True)


def read_trainable_weights(tag_dir: str, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """HF name -> fp32 tensor of every parameter a checkpoint saved with DeepSpeed's exclude_frozen_parameters holds
    (LoRA: the adapters and lora.modules_to_save, no frozen base), not the persistent buffers (read_buffers). ZeRO 1-3
    without pipeline: DeepSpeed's zero_to_fp32 of the optimizer's fp32 masters (no universal conversion: its
    converter expects every parameter); ZeRO-0 and pipelines: the module's own tensors, which equal the masters in
    fp32 runs only, so a bf16 one is refused rather than silently rounded."""
    saved = saved_layout(read_meta(tag_dir))
    # zero_to_fp32 cannot read AutoEP's per-expert files; the experts' adapters are read_expert_adapters'
    from_module = saved.pipeline_stages > 1 or saved.zero_stage == 0 or saved.expert_parallel > 1
    if from_module and saved.precision != "fp32":
        raise CheckpointError(f"{tag_dir} is a {saved.precision} LoRA checkpoint of a pipeline, ZeRO-0 or expert-"
                              "parallel run, whose saved dense adapters are rounded copies of the fp32 masters; "
                              "deepseek-ds reads them exactly from fp32 runs and from ZeRO 1-3 without pipeline or "
                              "EP: train with an fp32 DeepSpeed config such as ds_configs/zero1.json")
    with torch.device("meta"):
        layers = [spec.build() for spec in layer_specs(config, seed=None)]
    with trusted_types_only():
        if saved.pipeline_stages > 1 and saved.expert_parallel > 1:
            # DeepSpeed's MoE save of a pipeline writes each stage's module whole into mp_rank_<stage>, keyed
            # <layer index>.<key>; named as SequentialLM's below
            container = {f"layers.{k}": v for stage in range(saved.pipeline_stages) for k, v in torch.load(
                os.path.join(tag_dir, f"mp_rank_{stage:02d}_model_states.pt"), map_location="cpu",
                weights_only=True)["module"].items()}
        elif saved.pipeline_stages > 1:  # named as SequentialLM's (layers.<i>.<key>), as the branches below are
            container = {f"layers.{i}.{k}": v for i, state in _pipeline_layer_files(tag_dir) for k, v in state.items()}
        elif from_module:
            container = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu",
                                   weights_only=True)["module"]
        else:
            container = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(tag_dir), os.path.basename(tag_dir),
                                                                  exclude_frozen_parameters=True)
    out = {}
    for name, tensor in container.items():
        _, index, key = name.split(".", 2)
        layer = layers[int(index)]
        if _AUTOEP_ADAPTER.search(key):  # one rank's rows under every rank's name: read_expert_adapters has all
            continue
        if ".lora_" in key or key in dict(layer.named_parameters()):  # not the persistent buffers (buffers/ files)
            out[hf_name(layer, key)] = tensor.float()
    return out | read_expert_adapters(tag_dir)


def _tensor_parallel_weights(tag_dir: str, saved: Layout, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """An AutoTP checkpoint's weights, its shards gathered: every TP rank's model-states file (mp_rank_<r>) holds
    that rank's module, split layers concatenated along the dimension AutoTP split (models.tensor_parallel), the
    replicated ones taken from rank 0. In fp32 the module's weights are the optimizer's (ZeRO-1/2 keep no separate
    master copy); a bf16 module holds rounded copies, so that export is refused rather than silently rounded."""
    if saved.precision != "fp32":
        raise CheckpointError(f"{tag_dir} is a {saved.precision} tensor-parallel checkpoint; deepseek-ds gathers the "
                              "TP shards of fp32 runs only (its bf16 module weights are rounded copies of the fp32 "
                              "master weights); train with an fp32 DeepSpeed config such as ds_configs/zero1.json")
    shards = [torch.load(os.path.join(tag_dir, f"mp_rank_{r:02d}_model_states.pt"), map_location="cpu",
                         weights_only=True)["module"] for r in range(saved.tensor_parallel)]
    out = {}
    for name, tensor in shards[0].items():
        dim = split_dim(name, config.model_type)
        out[name] = tensor if dim is None else torch.cat([shard[name] for shard in shards], dim=dim)
    return out


def _autoep_expert_files(tag_dir: str) -> dict[str, torch.Tensor]:
    """AutoEP's grouped expert tensors (w1, w2, w3 of all experts, in expert order) from its per-expert files, whose
    layers are listed in the model-states files. DeepSpeed's own reader of them (consolidate_autoep_expert_files)
    writes a universal checkpoint; this one returns the tensors."""
    out = {}
    for states_file in sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt"))):
        states = torch.load(states_file, map_location="cpu", weights_only=True)
        for info in states.get("ds_autoep_layers") or []:
            prefix, experts = info["expert_key_prefix"], range(info["num_experts"])
            files = [torch.load(resolve_expert_ckpt_path(tag_dir, info["moe_layer_id"], e), map_location="cpu",
                                weights_only=True) for e in experts]
            for w in ("w1", "w2", "w3"):
                out[f"{prefix}.{w}"] = torch.stack([f[f"{prefix}.{w}.{e}"] for e, f in zip(experts, files)])
    return out
