"""The one table from `config.model_type` to its model family (family.Family): adding a family is adding its
folder and a line here."""

from __future__ import annotations

from . import deepseek_v2, deepseek_v3, deepseek_v4, deepseek_v32, dense, qwen2
from .family import Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    deepseek_v4.FAMILY,
    deepseek_v32.FAMILY,
    deepseek_v3.FAMILY,
    deepseek_v2.FAMILY,
    dense.FAMILY,
    qwen2.FAMILY,
)}


def family_of(config_or_model_type) -> Family:
    """The family of a transformers config (or of a model_type string)."""
    model_type = getattr(config_or_model_type, "model_type", config_or_model_type)
    return FAMILIES[model_type]
