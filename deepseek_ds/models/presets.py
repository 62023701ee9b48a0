"""Model presets as transformers configs: tiny CPU-sized models and the published DeepSeek shapes (each family's
own, in its folder), and building a model's config from a preset or an HF directory.

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
from typing import Any

from transformers import PretrainedConfig

from ..utils.errors import UserError
from .family import Preset
from .fp8 import quantization_of
from .registry import FAMILIES, family_of

# Every family's presets, the tiny CPU-sized ones first (as `deepseek-ds presets` lists them).
PRESETS: dict[str, Preset] = dict(sorted(((name, p) for f in FAMILIES.values() for name, p in f.presets.items()),
                                         key=lambda item: not item[0].startswith("tiny-")))

SUPPORTED_MODEL_TYPES = {f.model_type: f.config_cls for f in FAMILIES.values()}


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
    """Refuses what the layers cannot run exactly (each family's own refusal, e.g. Qwen2's sliding-window layers)."""
    refusal = family_of(config).refusal
    if refusal is not None and (message := refusal(config, source)) is not None:
        raise ModelConfigError(message)
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
_FAMILY_NOTES = {k: note for f in FAMILIES.values() for k, note in f.override_notes.items()}


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
    return family_of(config).is_moe


def first_moe_layer(config: PretrainedConfig) -> int:
    """The first decoder layer with routed experts (V2/V3: first_k_dense_replace; V4: every layer is MoE)."""
    return int(getattr(config, "first_k_dense_replace", 0) or 0)


def num_routed_experts(config: PretrainedConfig) -> int:
    return getattr(config, "n_routed_experts", 0) or 0 if is_moe(config) else 0
