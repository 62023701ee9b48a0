"""Between parallel layouts: DeepSpeed universal checkpoints, renamed for the model container that loads them,
and the fp32 weights of any checkpoint by HF name (what `export` reads).

DeepSpeed names a parameter after the module that holds it, and our two containers name layers differently:
SequentialLM (pipeline_stages = 1) `layers.<i>.<key>`, DeepSeekPipelineModule `<i>.<key>` (a tied embedding
`tied_modules.embed.<key>`), with i the index in the same layer-spec list. The HF name of a tensor
(models.layers.hf_key) depends on neither, so it is the key that both sides are mapped through.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil

import torch
from deepspeed.pipe import TiedLayerSpec

from .checkpoint import PIPELINE, SEQUENTIAL, CheckpointError, Layout, read_buffers, read_meta, trusted_types_only
from .models.layers import DecoderLayerPipe, hf_key
from .models.pipeline import layer_specs

SCHEMES = (SEQUENTIAL, PIPELINE)
_DONE = "universal.json"
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")


def _layout(config, scheme: str) -> dict[str, tuple[str, torch.Size]]:
    """DeepSpeed module name -> (HF name, shape) of every parameter and persistent buffer, for one container. The
    layers are built on the meta device: no memory, whatever the model size."""
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
                out[prefix + key] = (hf_key(layer, key), tensor.shape)
    return out


def layout_names(config, scheme: str) -> dict[str, str]:
    """DeepSpeed module name -> HF name of every parameter and persistent buffer, for one container."""
    return {name: hf for name, (hf, _) in _layout(config, scheme).items()}


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
    saved = Layout.from_dict(meta["layout"])
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
    _rename_params(os.path.join(tmp, "zero"), config, saved.scheme, scheme)
    with open(os.path.join(tmp, _DONE), "w") as f:
        json.dump({"source": tag_dir, "source_layout": meta["layout"], "scheme": scheme}, f, indent=2)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _rename_params(zero_dir: str, config, src: str, dst: str) -> None:
    if src == dst:
        return
    to_hf = layout_names(config, src)
    from_hf = {hf: name for name, hf in layout_names(config, dst).items()}
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
    meta = read_meta(tag_dir)
    saved = Layout.from_dict(meta["layout"])
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
    layout = _layout(config, scheme)
    out = {layout[k][0]: v.reshape(layout[k][1]) for k, v in weights.items() if k in layout}
    out.update(read_buffers(tag_dir))
    missing = sorted({hf for hf, _ in layout.values()} - set(out))
    if missing:
        raise CheckpointError(f"{tag_dir} lacks {len(missing)} tensors of its model, e.g. {missing[:3]}; the "
                              "checkpoint is incomplete or from another model config")
    return out


def _zero0_weights(tag_dir: str, saved: Layout, config) -> dict[str, torch.Tensor]:
    """ZeRO-0 keeps the model's own (full) weights in its model-states files: per layer for a pipeline, where a
    tied layer's file (named after its first use) holds what the module calls `tied_modules.<key>`."""
    if saved.pipeline_stages == 1:
        states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=True)
        return dict(states["module"])
    specs = layer_specs(config, seed=None)
    out = {}
    for name in os.listdir(tag_dir):
        m = _LAYER_FILE.match(name)
        if m:
            i = int(m.group(1))
            prefix = f"tied_modules.{specs[i].key}." if isinstance(specs[i], TiedLayerSpec) else f"{i}."
            layer = torch.load(os.path.join(tag_dir, name), map_location="cpu", weights_only=True)
            out.update({prefix + k: v for k, v in layer.items()})
    return out
