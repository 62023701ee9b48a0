"""A LoRA checkpoint (adapters, lora.modules_to_save, no frozen base) as peft's PeftModel on the base from the run's
model.path: `export lora` writes its adapter directory (adapter_config.json, adapter_model.safetensors, HF module
names), `export hf` its merged weights (peft's merge_and_unload: base + (alpha / r) B A), which eval and generate
also use for a LoRA checkpoint."""

from __future__ import annotations

import os

import torch
from deepspeed.pipe import TiedLayerSpec
from peft import PeftConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from ..checkpoint.format import read_meta, tag_dir_of
from ..checkpoint.state import read_buffers
from ..checkpoint.weights import read_trainable_weights
from ..config.schema import LoraSection
from ..models.hf_io import load_hf_weights, to_hf_model
from ..models.lora import ADAPTER, lora_config
from ..models.moe import BIAS, HF_ROUTERS
from ..models.pipeline import layer_specs, prepare_config
from ..models.presets import build_model_config
from ..models.registry import family_of
from ..utils.errors import UserError
from .hf_files import readable_by_all, save_tokenizer, training_tokenizer

_BASE_PREFIX = "base_model.model."  # where a PeftModel holds the transformers model
ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory peft's adapter directory


class LoraExportError(UserError):
    """A LoRA checkpoint that cannot be exported as asked."""


def is_lora_checkpoint(checkpoint: str) -> bool:
    return read_meta(tag_dir_of(checkpoint))["run_config"].get("lora", {}).get("r", 0) > 0


def _peft_name(hf: str, modules_to_save) -> str:
    """A trainable tensor's name in a PeftModel: adapters as they are, a modules_to_save tensor in peft's copy."""
    module, leaf = hf.rsplit(".", 1)
    if ".lora_" not in hf and module.rsplit(".", 1)[-1] in modules_to_save:
        module += f".modules_to_save.{ADAPTER}"
    return f"{_BASE_PREFIX}{module}.{leaf}"


def peft_model_from_checkpoint(checkpoint: str, experts_implementation: str = "grouped_mm") -> tuple[PeftModel, dict]:
    """(fp32 PeftModel in eval mode: the base read from the run's model.path as training read it, the checkpoint's
    adapters, modules_to_save and persistent buffers; the checkpoint's metadata)."""
    tag_dir = tag_dir_of(checkpoint)
    meta = read_meta(tag_dir)
    section = LoraSection(**meta["run_config"]["lora"])
    base_path = meta["run_config"]["model"]["path"]
    if not base_path or not os.path.isdir(base_path):
        raise LoraExportError(f"the LoRA checkpoint {tag_dir} holds no base weights and its model.path {base_path!r} "
                              "is not a directory; put the base model back there (checkpoints keep only adapters)")
    config = build_model_config(path=tag_dir)
    config = prepare_config(config, family_of(config).export_attention, experts_implementation)
    layers = [spec.build() for spec in layer_specs(config, seed=None)
              if not (isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None)]
    load_hf_weights(layers, base_path, config)
    base = to_hf_model(layers, config)
    routers = _moved_routers(base, read_buffers(tag_dir), tag_dir)
    model = get_peft_model(base, lora_config(section, config, modules_to_save=True, routers=routers),
                           adapter_name=ADAPTER)
    model.peft_config[ADAPTER].base_model_name_or_path = os.path.abspath(base_path)
    params = dict(model.named_parameters())
    # The routers' copies hold the base's weight (frozen in training) beside the moved bias: nothing to copy in.
    wanted = {name for name, p in params.items()
              if p.requires_grad and not any(f".{r}.modules_to_save." in name for r in routers)}
    saved = {_peft_name(hf, section.modules_to_save): t for hf, t in read_trainable_weights(tag_dir, config).items()}
    if set(saved) != wanted:
        raise LoraExportError(f"{tag_dir} does not hold the adapters of its run's lora section: missing "
                              f"{sorted(wanted - set(saved))[:3]}, unexpected {sorted(set(saved) - wanted)[:3]}")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    return model.eval(), meta


def _moved_routers(base, buffers: dict[str, torch.Tensor], tag_dir: str) -> tuple[str, ...]:
    """Load the checkpoint's persistent buffers into the base; return the module names (peft's modules_to_save
    match by suffix) of the routers whose e_score_correction_bias training moved (moe.bias_update_speed > 0). A peft
    adapter holds no buffers of its own, but a modules_to_save copy carries its module's: with the routers among
    them, PeftModel.from_pretrained(base, adapter) routes as training left the model."""
    before = {name: b.clone() for name, b in base.named_buffers()}
    _, unexpected = base.load_state_dict(buffers, strict=False)
    if unexpected:
        raise LoraExportError(f"{tag_dir}/buffers holds tensors its model lacks, e.g. {unexpected[:3]}")
    moved = {name.rsplit(".", 1)[-1] for name, m in base.named_modules()
             if isinstance(m, HF_ROUTERS) and hasattr(m, BIAS) and not torch.equal(getattr(m, BIAS), before[f"{name}.{BIAS}"])}
    return tuple(sorted(moved))


def export_lora(checkpoint: str, out: str, data_dir: str | None = None) -> str:
    """peft's adapter directory of a LoRA checkpoint (with the training data's tokenizer and chat template), which
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out) loads."""
    if not is_lora_checkpoint(checkpoint):
        raise LoraExportError(f"{tag_dir_of(checkpoint)} is not a LoRA checkpoint (lora.r is 0): use `deepseek-ds "
                              "export hf` for the weights of a full fine-tuning run")
    model, meta = peft_model_from_checkpoint(checkpoint)
    tok = training_tokenizer(meta, data_dir)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    readable_by_all(out)
    return out


def merged_model_from_checkpoint(checkpoint: str, experts_implementation: str = "grouped_mm"):
    """(fp32 transformers CausalLM with the adapters merged into the base by peft, the checkpoint's metadata)."""
    model, meta = peft_model_from_checkpoint(checkpoint, experts_implementation)
    return model.merge_and_unload(), meta


def adapter_model(adapter_dir: str):
    """fp32 transformers CausalLM in eval mode: the base named in a peft adapter directory with the adapter merged
    (peft's own loading, as a user's PeftModel.from_pretrained)."""
    base = PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    if not base or not os.path.isdir(base):
        raise LoraExportError(f"the adapter in {adapter_dir} names its base model {base!r}, which is not a local "
                              f"directory; set base_model_name_or_path in its {ADAPTER_CONFIG}")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
