"""Between parallel layouts: DeepSpeed universal checkpoints, renamed for the model container that loads them,
and the fp32 weights of any checkpoint by HF name (what `export` reads).

DeepSpeed names a parameter after the module that holds it, and our two containers name layers differently:
SequentialLM (pipeline_stages = 1) `layers.<i>.<key>`, DeepSeekPipelineModule `<i>.<key>` (a tied embedding
`tied_modules.embed.<key>`), with i the index in the same layer-spec list. The HF name of a tensor
(models.layers.hf_key) depends on neither, so it is the key that both sides are mapped through.

With expert parallelism (parallel.expert_parallel > 1) DeepSpeed's AutoEP has replaced every MoE block `mlp`: its
router sits at `mlp.router` (the linear layer at `mlp.router.gate`) and its experts are grouped tensors `w1` (gate),
`w3` (up), `w2` (down), full size (all experts, in expert order) in a universal checkpoint. transformers fuses gate and
up into one `gate_up_proj` (E, 2I, H): w1 and w3 are its two halves along dim 1.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import re
import shutil
from typing import NamedTuple

import torch
from deepspeed.pipe import TiedLayerSpec

from .checkpoint import (PIPELINE, SEQUENTIAL, CheckpointError, Layout, read_buffers, read_meta, saved_layout,
                         trusted_types_only)
from .models.layers import DecoderLayerPipe, hf_key
from .models.pipeline import layer_specs

SCHEMES = (SEQUENTIAL, PIPELINE)
_DONE = "universal.json"
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")


class Entry(NamedTuple):
    """Where a DeepSpeed tensor goes in the HF checkpoint: all of `hf`, or with `part` = (i, n) the i-th of n equal
    blocks along dim 1 (AutoEP's w1 and w3 in the fused gate_up_proj)."""
    hf: str
    shape: torch.Size
    part: tuple[int, int] | None = None


_MLP = "layer.mlp."  # a decoder layer's MLP, dense or MoE, inside DecoderLayerPipe (and MTPLayerPipe)


def _autoep_names(config) -> dict[str, list[tuple[str, tuple[int, int] | None]]]:
    """Key in transformers' MoE block -> [(key in AutoEP's, part)]. transformers' names come from DeepSpeed's AutoEP
    preset for the model; AutoEP's own (router, experts.w1/w2/w3) are fixed by its AutoEPMoELayer, which has no
    mapping back to the preset's, hence written out here."""
    from deepspeed.module_inject.auto_ep_presets.registry import get_preset

    p = get_preset(config.model_type)
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


def _layout(config, scheme: str, autoep: bool = False) -> dict[str, Entry]:
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
            for key, tensor in layer.state_dict().items():
                if isinstance(layer, DecoderLayerPipe) and key.startswith("rotary."):
                    continue
                for ds_key, shape, part in _deepspeed_keys(key, tensor.shape, renames):
                    out[prefix + ds_key] = Entry(hf_key(layer, key), shape, part)
    return out


def layout_names(config, scheme: str, autoep: bool = False) -> dict[str, str]:
    """DeepSpeed module name -> HF name of every parameter and persistent buffer, for one container."""
    return {name: entry.hf for name, entry in _layout(config, scheme, autoep).items()}


def _hf_tensors(weights: dict[str, torch.Tensor], layout: dict[str, Entry]) -> dict[str, torch.Tensor]:
    """DeepSpeed tensors by module name -> HF tensors; the parts of a fused tensor are concatenated in order (one with
    a part missing is left out, so reported missing)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    counts = {}
    for name, tensor in weights.items():
        if name in layout:
            entry = layout[name]
            index, counts[entry.hf] = entry.part or (0, 1)
            parts.setdefault(entry.hf, {})[index] = tensor.reshape(entry.shape)
    return {hf: torch.cat([p[i] for i in range(counts[hf])], dim=1) if counts[hf] > 1 else p[0]
            for hf, p in parts.items() if len(p) == counts[hf]}


def universal_dir(tag_dir: str, scheme: str) -> str:
    # Beside the tag directory, not in it: DeepSpeed's converter collects a tag's files recursively.
    return f"{os.path.normpath(tag_dir)}.universal-{scheme}"


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _DONE))


def to_universal(tag_dir: str, scheme: str, config, out: str | None = None, workers: int = 1) -> str:
    """Convert a ZeRO >= 1 checkpoint into a universal one whose parameter folders carry the names of `scheme`'s
    container; done once (published atomically, like a checkpoint). Returns the output directory."""
    from deepspeed.checkpoint import ds_to_universal

    out = out or universal_dir(tag_dir, scheme)
    if is_converted(out):
        return out
    meta = read_meta(tag_dir)
    saved = saved_layout(meta)
    if saved.zero_stage == 0:
        raise CheckpointError(f"{tag_dir} was saved with ZeRO stage 0, which has no optimizer shards to build a "
                              "universal checkpoint from; resume it with its own pipeline layout")
    parent, name = os.path.split(os.path.normpath(out))
    tmp = os.path.join(parent, f".{name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=tag_dir, output_folder=tmp, num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=False)
    with trusted_types_only(), contextlib.redirect_stdout(io.StringIO()):  # its progress prints are not ours
        ds_to_universal.main(args)
    # It also points a `latest_universal` file in the parent directory at the temporary name: not ours to keep.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(parent, "latest_universal"))
    _rename_params(os.path.join(tmp, "zero"), config, saved.scheme, scheme, saved.autoep)
    with open(os.path.join(tmp, _DONE), "w") as f:
        json.dump({"source": tag_dir, "source_layout": meta["layout"], "scheme": scheme}, f, indent=2)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _rename_params(zero_dir: str, config, src: str, dst: str, autoep: bool) -> None:
    if src == dst:
        return
    to_hf = {name: (entry.hf, entry.part) for name, entry in _layout(config, src, autoep).items()}
    from_hf = {(entry.hf, entry.part): name for name, entry in _layout(config, dst, autoep).items()}
    for name in os.listdir(zero_dir):
        if not os.path.isdir(os.path.join(zero_dir, name)):
            continue  # optimizer_state.pt: global optimizer settings
        if name not in to_hf:
            raise CheckpointError(f"universal checkpoint parameter {name!r} is not a {src} parameter of this model; "
                                  "the checkpoint was written for another model config")
        os.rename(os.path.join(zero_dir, name), os.path.join(zero_dir, from_hf[to_hf[name]]))


def hf_state_dict_from_checkpoint(tag_dir: str, config, work_dir: str) -> dict[str, torch.Tensor]:
    """fp32 weights (the optimizer's master copies for ZeRO >= 1) and persistent buffers of a checkpoint, by HF
    name, whatever its ZeRO stage or pipeline layout. A universal conversion already beside the checkpoint is
    reused; otherwise one is made in `work_dir`."""
    saved = saved_layout(read_meta(tag_dir))
    if saved.zero_stage == 0:
        scheme, weights = saved.scheme, _zero0_weights(tag_dir, saved, config)
    else:
        scheme = next((s for s in SCHEMES if is_converted(universal_dir(tag_dir, s))), saved.scheme)
        uni = universal_dir(tag_dir, scheme)
        if not is_converted(uni):
            uni = to_universal(tag_dir, scheme, config, out=os.path.join(work_dir, "universal"))
        weights = {}
        zero = os.path.join(uni, "zero")
        for name in os.listdir(zero):
            path = os.path.join(zero, name, "fp32.pt")
            if os.path.isfile(path):
                state = torch.load(path, map_location="cpu", weights_only=True)
                # ZeRO-1/2 conversions store {"param": tensor, ...}, ZeRO-3's the bare, flat tensor.
                weights[name] = state["param"] if isinstance(state, dict) else state
    layout = _layout(config, scheme, saved.autoep)
    out = _hf_tensors(weights, layout)
    out.update(read_buffers(tag_dir))
    missing = sorted({entry.hf for entry in layout.values()} - set(out))
    if missing:
        raise CheckpointError(f"{tag_dir} lacks {len(missing)} tensors of its model, e.g. {missing[:3]}; the "
                              "checkpoint is incomplete or from another model config")
    return out


def _zero0_weights(tag_dir: str, saved: Layout, config) -> dict[str, torch.Tensor]:
    """ZeRO-0 keeps the model's own (full) weights in its model-states files: per layer for a pipeline, where a
    tied layer's file (named after its first use) holds what the module calls `tied_modules.<key>`; AutoEP's experts
    are in files of their own."""
    out = _autoep_expert_files(tag_dir) if saved.autoep else {}
    if saved.pipeline_stages == 1:
        states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=True)
        out.update(states["module"])
        return out
    specs = layer_specs(config, seed=None)
    for name in os.listdir(tag_dir):
        m = _LAYER_FILE.match(name)
        if m:
            i = int(m.group(1))
            prefix = f"tied_modules.{specs[i].key}." if isinstance(specs[i], TiedLayerSpec) else f"{i}."
            layer = torch.load(os.path.join(tag_dir, name), map_location="cpu", weights_only=True)
            out.update({prefix + k: v for k, v in layer.items()})
    return out


def _autoep_expert_files(tag_dir: str) -> dict[str, torch.Tensor]:
    """AutoEP's grouped expert tensors (w1, w2, w3 of all experts, in expert order) from its per-expert files, whose
    layers are listed in the model-states files. DeepSpeed's own reader of them (consolidate_autoep_expert_files)
    writes a universal checkpoint; this one returns the tensors."""
    from deepspeed.checkpoint.autoep_universal import resolve_expert_ckpt_path

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
