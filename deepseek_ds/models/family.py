"""What a model family is: the `Family` record each family folder (deepseek_v3/, deepseek_v2/, dense/, qwen2/)
provides, and its `Preset`s. A leaf module: the family folders import it, registry.py collects them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    config_cls: type
    fields: dict[str, Any]
    description: str


@dataclass(frozen=True)
class Family:
    model_type: str                 # transformers' config.model_type
    config_cls: type                # transformers' config class
    causal_lm: type                 # the transformers classes the pipeline layers wrap
    decoder_layer: type
    norm: type
    rotary: type
    presets: dict[str, Preset]      # model.preset names of this family
    lora_targets: tuple[str, ...]   # LoRA's default target_modules
    tp_attention_specs: tuple[dict, ...]  # AutoTP layer specs of the attention (the MLP's are shared)
    moe_defaults: dict[str, float] | None = None  # published load-balancing settings; None: dense
    score_func: str | None = None   # the routers' affinity: "sigmoid" or "softmax"; None: dense
    has_router_bias: bool = False   # routers carry e_score_correction_bias (auxiliary-loss-free balancing)
    router_group_mask: bool = False  # the router keeps a group-limited choice mask per token (activation memory)
    has_mtp: bool = False           # multi-token-prediction modules (num_nextn_predict_layers)
    # Why one of this family's config fields does not apply to another family (model.overrides errors).
    override_notes: dict[str, str] = field(default_factory=dict)
    # What the layers cannot run exactly: (config, source) -> the refusal's message, or None.
    refusal: Callable[[Any, str], str | None] | None = None

    @property
    def is_moe(self) -> bool:
        return self.moe_defaults is not None
