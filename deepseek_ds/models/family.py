"""What a model family is: the `Family` record each family folder (deepseek_v3/, deepseek_v2/, dense/, qwen2/)
provides, and its `Preset`s. A leaf module: the family folders import it, registry.py collects them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def cached_on(position_ids, key, build: Callable[[], Any]) -> Any:
    """An attention mask (or its keyword arguments) kept on the stage's position ids, the shared layers' and a
    family's alike: one per stage and micro-batch, whatever its layers; build() once per `key`."""
    cached = getattr(position_ids, "_document_attention", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = build()
    position_ids._document_attention = (key, value)
    return value


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
    # The run options (a config.RunConfig) its layers cannot train exactly: (run config, model config) -> messages.
    run_refusals: Callable[[Any, Any], list[str]] | None = None
    # Parallelism its layers cannot split exactly: a `parallel` field (e.g. "tensor_parallel") -> why (config's
    # model_rules refuses it above 1, naming the field, the reason and the fix).
    refused_parallelism: dict[str, str] = field(default_factory=dict)
    # DeepSeek-V4's pipeline needs, read by models/layers.py (None / False for the other families):
    streams_head: type | None = None  # hyper-connections: the module collapsing config.hc_mult streams before the norm
    carries_token_ids: bool = False   # every stage gets the input ids (hash-routed MoE layers)
    # The decoder layer's keyword arguments: (config, rotary, hidden, position_ids, input_ids) -> kwargs.
    layer_kwargs: Callable[..., dict] | None = None
    # After a layer's shared initialisation: (module, seed or None) -> None; the family's own init and frozen parts.
    prepare_layer: Callable[[Any, int | None], None] | None = None
    # The attn_implementations its layers run (export and tracing pick one; model.attn_implementation is refused
    # outside them, with attention_note's reason); None: any transformers has.
    attention_kernels: tuple[str, ...] | None = None
    attention_note: str = ""
    # Checkpoints name its tensors as transformers' conversion_mapping sources (published names, which its
    # save_pretrained writes), not as in memory: loading resolves them with that mapping (checkpoint_names.py).
    renamed_on_disk: bool = False
    # DeepSpeed AutoEP's preset for its MoE blocks, where that is another family's (None: its own model_type's).
    autoep_preset: str | None = None

    @property
    def is_moe(self) -> bool:
        return self.moe_defaults is not None

    @property
    def export_attention(self) -> str:
        """The attn_implementation exports and traces run: SDPA unless its layers run only other kernels."""
        kernels = self.attention_kernels
        return "sdpa" if kernels is None or "sdpa" in kernels else kernels[0]
