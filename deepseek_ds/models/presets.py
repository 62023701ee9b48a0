"""Model presets as transformers configs: tiny CPU-sized models and the published DeepSeek shapes.

The real shapes are copied from the public config.json files of the released checkpoints; only the fields
that differ from transformers' defaults for that config class are spelled out. DeepSeek-R1-Distill-Qwen checkpoints
are Qwen2.5(-Math) models (transformers' `qwen2`: Llama blocks with biases on q/k/v); the R1-Distill-Llama ones
are `llama` and need no preset of their own (model.path).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig, PretrainedConfig, Qwen2Config

from ..utils.errors import UserError
from .fp8 import quantization_of


@dataclass(frozen=True)
class Preset:
    config_cls: type
    fields: dict[str, Any]
    description: str


_TINY_MLA = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
    v_head_dim=32, qk_nope_head_dim=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    first_k_dense_replace=1, max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
)

PRESETS: dict[str, Preset] = {
    "tiny-v3": Preset(DeepseekV3Config, dict(_TINY_MLA, n_group=4, topk_group=2, num_nextn_predict_layers=0),
                      "DeepSeek-V3 architecture (MLA, sigmoid group-limited routing, 1 shared + 8 routed experts), ~2.2M params"),
    "tiny-v2": Preset(DeepseekV2Config, dict(_TINY_MLA, n_group=1, topk_group=1, topk_method="greedy"),
                      "DeepSeek-V2 architecture (MLA, softmax routing, 1 shared + 8 routed experts), ~2.2M params"),
    "tiny-dense": Preset(LlamaConfig, dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                           bos_token_id=0, eos_token_id=0),
                         "DeepSeek LLM/Coder architecture (Llama layout), ~1.3M params"),
    # Grouped-query attention (2 KV heads for 4 query heads) and untied head, as R1-Distill-Qwen has.
    "tiny-qwen2": Preset(Qwen2Config, dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
                         "DeepSeek-R1-Distill-Qwen architecture (Qwen2: q/k/v biases, GQA), ~1.3M params"),
    "deepseek-v3": Preset(DeepseekV3Config, dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=0, eos_token_id=1), "DeepSeek-V3 671B (37B active)"),
    "deepseek-v2": Preset(DeepseekV2Config, dict(
        vocab_size=102400, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=60,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=2, n_routed_experts=160, routed_scaling_factor=16.0,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=3, topk_method="group_limited_greedy", num_experts_per_tok=6, first_k_dense_replace=1,
        max_position_embeddings=163840, bos_token_id=100000, eos_token_id=100001), "DeepSeek-V2 236B (21B active)"),
    "deepseek-v2-lite": Preset(DeepseekV2Config, dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1,
        topk_group=1, topk_method="greedy", num_experts_per_tok=6, first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
        bos_token_id=100000, eos_token_id=100001), "DeepSeek-V2-Lite 16B (2.4B active)"),
    "deepseek-llm-7b": Preset(LlamaConfig, dict(
        vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=100000,
        eos_token_id=100001), "DeepSeek LLM 7B (dense)"),
    "deepseek-coder-6.7b": Preset(LlamaConfig, dict(
        vocab_size=32256, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=16384, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "linear", "rope_theta": 100000.0, "factor": 4.0}, bos_token_id=32013,
        eos_token_id=32021), "DeepSeek-Coder 6.7B (dense, Llama layout)"),
    "deepseek-r1-distill-qwen-1.5b": Preset(Qwen2Config, dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_sliding_window=False, sliding_window=4096,
        max_window_layers=21, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
        "DeepSeek-R1-Distill-Qwen 1.5B (dense, Qwen2 layout)"),
    "deepseek-r1-distill-qwen-7b": Preset(Qwen2Config, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_sliding_window=False, sliding_window=4096,
        max_window_layers=28, tie_word_embeddings=False, bos_token_id=151646, eos_token_id=151643),
        "DeepSeek-R1-Distill-Qwen 7B (dense, Qwen2 layout)"),
}

SUPPORTED_MODEL_TYPES = {"deepseek_v3": DeepseekV3Config, "deepseek_v2": DeepseekV2Config, "llama": LlamaConfig,
                         "qwen2": Qwen2Config}


class ModelConfigError(UserError):
    pass


def build_model_config(preset: str | None = None, path: str | None = None,
                       overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """A transformers config from a preset name or a local HF directory, with field overrides applied."""
    if path:
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ModelConfigError(f"model.path: {path!r} has no config.json; point it at a local HF model directory")
        with open(cfg_file) as f:
            raw = json.load(f)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(f"model.path: model_type {model_type!r} in {cfg_file} is not supported; "
                                   f"expected one of {sorted(SUPPORTED_MODEL_TYPES)}")
        quantization_of(raw, cfg_file)  # refuses a layout load_hf_weights cannot dequantize, before any work
        # auto_map names the remote code transformers now ships itself; quantization_config describes the files, not
        # the model: weights are dequantized on load, and a config carrying it would make from_pretrained of our
        # checkpoints and exports quantize again.
        dropped = ("architectures", "transformers_version", "auto_map", "quantization_config")
        fields = {k: v for k, v in raw.items() if k not in dropped}
        _check_overrides(SUPPORTED_MODEL_TYPES[model_type], overrides)
        fields.update(overrides or {})
        return _supported(SUPPORTED_MODEL_TYPES[model_type](**fields), cfg_file)
    if preset not in PRESETS:
        raise ModelConfigError(f"model.preset: unknown preset {preset!r}; choose one of {sorted(PRESETS)} or set model.path")
    p = PRESETS[preset]
    _check_overrides(p.config_cls, overrides)
    return _supported(p.config_cls(**{**p.fields, **(overrides or {})}), f"preset {preset}")


def _supported(config: PretrainedConfig, source: str) -> PretrainedConfig:
    """Refuses what the layers cannot run exactly: Qwen2's sliding-window layers (use_sliding_window: true) would
    need a windowed mask in every stage's document_attention, which builds full causal masks only."""
    sliding = [i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind == "sliding_attention"]
    if sliding:
        raise ModelConfigError(f"model: {source} has use_sliding_window true (layers {sliding[0]}-{sliding[-1]} "
                               "sliding-window attention), which deepseek-ds does not train; set "
                               "model.overrides.use_sliding_window: false (DeepSeek-R1-Distill-Qwen ships false)")
    return config


@functools.cache
def config_fields(config_cls: type) -> frozenset[str]:
    """The field names a transformers config class knows: its serialized fields, its __init__ arguments and its
    aliases (attribute_map). A config accepts any other keyword too and keeps it as a stray attribute, which is
    how a misspelt override would be ignored."""
    params = inspect.signature(config_cls.__init__).parameters
    named = {n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(set(config_cls().to_dict()) | named | set(getattr(config_cls, "attribute_map", {})))


# Why a field of another family does not apply, where a plain "not a field" would leave the user guessing.
_FAMILY_NOTES = {"num_nextn_predict_layers": "multi-token prediction is DeepSeek-V3's"}


def _check_overrides(config_cls: type, overrides: dict[str, Any] | None) -> None:
    known = config_fields(config_cls)
    problems = []
    for key in overrides or {}:
        if key in known:
            continue
        others = [c for c in SUPPORTED_MODEL_TYPES.values() if c is not config_cls and key in config_fields(c)]
        other = others[0] if others else None
        if other is not None:
            note = _FAMILY_NOTES.get(key, f"it is a field of {other.__name__}")
            problems.append(f"model.overrides.{key}: {note} (model_type {other.model_type}), not "
                            f"{config_cls.model_type}'s; remove it from model.overrides")
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"see transformers' {config_cls.__name__} for its fields"
        problems.append(f"model.overrides.{key} is not a field of {config_cls.__name__}; {hint}")
    if problems:
        raise ModelConfigError("; ".join(problems))


def is_moe(config: PretrainedConfig) -> bool:
    return config.model_type in ("deepseek_v3", "deepseek_v2")


def num_routed_experts(config: PretrainedConfig) -> int:
    return getattr(config, "n_routed_experts", 0) or 0 if is_moe(config) else 0
