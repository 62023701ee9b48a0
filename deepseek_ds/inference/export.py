"""Export a training checkpoint (any ZeRO stage, any pipeline layout) as a Hugging Face directory, a TorchScript
module or an ONNX graph. TorchScript and ONNX exports are run on inputs of other shapes than the traced one and
compared with PyTorch before they are reported as done.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import warnings

import numpy as np
import torch
from deepspeed.pipe import TiedLayerSpec
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.export import Dim
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..checkpoint.format import META, read_meta, tag_dir_of
from ..checkpoint.weights import read_weights
from ..models.hf_io import mtp_hf_state_dict, to_hf_model
from ..models.names import hf_names
from ..models.pipeline import layer_specs, prepare_config
from ..models.presets import build_model_config, is_moe
from ..models.registry import family_of
from ..utils.errors import UserError
from ..utils.private_api import ONNX_REGISTRATION_LOGGER, keep_in_fp32_modules, own_tensor_stores
from .export_lora import is_lora_checkpoint, merged_model_from_checkpoint
from .hf_files import readable_by_all, save_tokenizer, set_inference_fields, training_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Trace-safe expert kernel: `eager` loops over the experts that received tokens and `grouped_mm` sizes its groups
# from the routing, so a trace would freeze the example's routing; batched_mm gathers each token's expert weights
# with plain indexing, the same math for every input.
TRACE_EXPERTS = "batched_mm"
CHECK_SHAPES = ((1, 7), (3, 29))  # differ from the traced example in both dynamic axes


class ExportError(UserError):
    """An export that failed or does not reproduce PyTorch's outputs."""


# ----------------------------------------------------------------------------------------------- HF model
def _checkpoint_layers(checkpoint: str, work_dir: str, experts_implementation: str
                       ) -> tuple[list[nn.Module], PretrainedConfig, dict]:
    """(every pipeline layer of the checkpoint's model holding its fp32 weights, the model config, the metadata)."""
    tag_dir = tag_dir_of(checkpoint)
    meta = read_meta(tag_dir)
    config = build_model_config(path=tag_dir)
    config = prepare_config(config, family_of(config).export_attention, experts_implementation)
    weights = read_weights(tag_dir, config, work_dir)
    with torch.device("meta"):
        layers = [spec.build() for spec in layer_specs(config, seed=None)
                  if not (isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None)]
    for layer in layers:  # integer buffers (DeepSeek-V4's hash tables, tid2eid) keep their dtype
        layer.load_state_dict({k: weights[hf].float() if weights[hf].is_floating_point() else weights[hf]
                               for k, hf in hf_names(layer).items()}, strict=False, assign=True)
    return layers, config, meta


def hf_model_from_checkpoint(checkpoint: str, work_dir: str, experts_implementation: str = "grouped_mm"):
    """(fp32 transformers CausalLM in eval mode holding the checkpoint's weights, the checkpoint's metadata)."""
    if is_lora_checkpoint(checkpoint):
        return merged_model_from_checkpoint(checkpoint, experts_implementation)
    layers, config, meta = _checkpoint_layers(checkpoint, work_dir, experts_implementation)
    return to_hf_model(layers, config), meta


def _keeps_fp32(model: nn.Module):
    """Whether transformers keeps a tensor (by name) in fp32 whatever the dtype: the router weights and bias."""
    keep = keep_in_fp32_modules(model)
    keep_rx = re.compile("|".join(re.escape(k) for k in keep)) if keep else None
    return lambda name: bool(keep_rx and keep_rx.search(name))


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating tensors except those transformers keeps in fp32, as from_pretrained(dtype=...) will."""
    keeps_fp32 = _keeps_fp32(model)
    for prefix, mod in model.named_modules():
        for store in own_tensor_stores(mod):
            for name, t in store.items():
                full = f"{prefix}.{name}" if prefix else name
                if t is None or not t.is_floating_point() or keeps_fp32(full):
                    continue
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(dtype)
                else:
                    store[name] = t.to(dtype)


def export_hf(checkpoint: str, out: str, dtype: str = "bf16", data_dir: str | None = None,
              max_shard_size: str = "5GB", work_dir: str | None = None) -> str:
    """Write a from_pretrained-ready directory: config.json, sharded safetensors (fused experts converted to the
    per-expert layout by save_pretrained), the MTP modules in the published layout (model-mtp.safetensors, which
    transformers' MtpModel.from_pretrained reads: it finds them by V3's `model.layers.61.*`, other shapes need that
    pattern set on the main model), and the tokenizer of the data the checkpoint was trained on (with the chat
    template that data was rendered with, and its special-token ids in config.json and generation_config.json)."""
    if is_lora_checkpoint(checkpoint):  # merged: base + scaled B A, by peft
        model, meta = merged_model_from_checkpoint(checkpoint)
        layers, config = [], model.config
    else:
        if work_dir:  # --work-dir names where to put it: made if absent
            os.makedirs(work_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
            layers, config, meta = _checkpoint_layers(checkpoint, tmp, "grouped_mm")
        model = to_hf_model(layers, config)
    return write_hf_dir(model, layers, config, training_tokenizer(meta, data_dir), out, dtype, max_shard_size)


def write_hf_dir(model: nn.Module, layers, config, tok, out: str, dtype: str = "bf16", max_shard_size: str = "5GB",
                 config_pad: bool = True) -> str:
    """A transformers CausalLM (to_hf_model of `layers`) as a from_pretrained-ready directory in `dtype`: its
    weights, the MTP modules of `layers` in the published layout, and the tokenizer `tok` with its chat template, its
    special-token ids and the KV cache on in the configs (hf_files.set_inference_fields, with config_pad). What
    `export hf` and `models init` write."""
    keeps_fp32 = _keeps_fp32(model)
    mtp = {k: v if keeps_fp32(k) or not v.is_floating_point() else v.to(DTYPES[dtype])
           for k, v in mtp_hf_state_dict(layers, config).items()}
    _cast(model, DTYPES[dtype])
    model.config.dtype = DTYPES[dtype]
    set_inference_fields(model, tok, config_pad)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    if mtp:
        add_to_hf_dir(out, mtp, "model-mtp.safetensors")
    save_tokenizer(tok, out)
    readable_by_all(out)
    return out


def add_to_hf_dir(hf_dir: str, tensors: dict[str, torch.Tensor], filename: str) -> None:
    """Add a safetensors file to a save_pretrained directory and list its tensors in the sharded index. A lone
    model.safetensors becomes a one-shard index first: transformers reads that file, when present, instead of the
    index."""
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
    else:
        shard = "model-00001-of-00001.safetensors"
        os.replace(os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, shard))
        with safe_open(os.path.join(hf_dir, shard), "pt") as f:
            index = {"metadata": {"total_size": sum(f.get_tensor(k).nbytes for k in f.keys())},
                     "weight_map": {k: shard for k in f.keys()}}
    clash = sorted(set(tensors) & set(index["weight_map"]))
    if clash:
        raise ExportError(f"{hf_dir} already holds {clash[:3]}")
    save_file(tensors, os.path.join(hf_dir, filename), metadata={"format": "pt"})
    index["weight_map"].update({k: filename for k in tensors})
    index["metadata"]["total_size"] = int(index["metadata"].get("total_size", 0)) + sum(
        t.numel() * t.element_size() for t in tensors.values())
    tmp = index_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    os.replace(tmp, index_path)


# ----------------------------------------------------------------------------------------------- traced formats
class LogitsOnly(nn.Module):
    """input_ids -> logits: the one tensor in, one tensor out signature TorchScript and ONNX want."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def model_for_tracing(source: str, work_dir: str) -> nn.Module:
    """fp32 LogitsOnly model from a training checkpoint or an HF directory (e.g. one `export hf` wrote)."""
    is_hf_dir = os.path.isfile(os.path.join(source, "config.json")) and not os.path.isfile(os.path.join(source, META))
    if is_hf_dir:
        config = AutoConfig.from_pretrained(source)
        kwargs = {"experts_implementation": TRACE_EXPERTS} if is_moe(config) else {}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                     attn_implementation=family_of(config).export_attention, **kwargs)
    else:
        model, _ = hf_model_from_checkpoint(source, work_dir, experts_implementation=TRACE_EXPERTS)
    return LogitsOnly(model.float()).eval()


def _inputs(model: LogitsOnly, shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, model.model.config.vocab_size, s, generator=gen) for s in shapes]


def check_against_pytorch(model: LogitsOnly, run, atol: float) -> float:
    """Largest |exported - PyTorch| over CHECK_SHAPES inputs; ExportError above atol."""
    worst = 0.0
    with torch.no_grad():
        for ids in _inputs(model, CHECK_SHAPES):
            got = np.asarray(run(ids))
            worst = max(worst, float(np.abs(got - model(ids).numpy()).max()))
    if worst > atol:
        raise ExportError(f"the export's logits differ from PyTorch's by {worst:.2e} (> atol {atol:.0e})")
    return worst


def export_torchscript(model: LogitsOnly, out: str, atol: float = 1e-4) -> float:
    example = _inputs(model, [(2, 16)])[0]
    with torch.no_grad():
        traced = torch.jit.trace(model, example, check_trace=False)
    traced.save(out)
    loaded = torch.jit.load(out)
    return check_against_pytorch(model, lambda ids: loaded(ids).numpy(), atol)


def export_onnx(model: LogitsOnly, out: str, atol: float = 1e-4) -> float:
    import onnxruntime  # optional (the `export` extra), and only this format needs it

    example = _inputs(model, [(2, 16)])[0]
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    # The exporter warns about torchvision ops it cannot register (not installed, never used by a language model)
    # and about a pytree API torch itself calls: nothing the user can act on.
    registration = logging.getLogger(ONNX_REGISTRATION_LOGGER)
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated", category=FutureWarning)
            torch.onnx.export(model, (example,), out, dynamo=True, input_names=["input_ids"], output_names=["logits"],
                              dynamic_shapes={"input_ids": {0: Dim("batch"), 1: Dim("sequence")}},
                              external_data=size > 1.5 * 2**30, verbose=False)  # protobuf caps a file at 2 GiB
    finally:
        registration.setLevel(level)
    session = onnxruntime.InferenceSession(out, providers=["CPUExecutionProvider"])
    return check_against_pytorch(model, lambda ids: session.run(None, {"input_ids": ids.numpy()})[0], atol)
