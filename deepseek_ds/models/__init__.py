"""The models: transformers' own modules as pipeline layers, and what training needs around them.

One folder a model family, keyed by transformers' `config.model_type`: deepseek_v4/ (DeepSeek-V4), deepseek_v32/
(DeepSeek-V3.2), deepseek_v3/ (DeepSeek-V3), deepseek_v2/ (DeepSeek-V2, V2-Lite), dense/ (`llama`: DeepSeek LLM /
Coder, R1-Distill-Llama) and qwen2/ (R1-Distill-Qwen).
registry.py maps a model_type to its family (`family_of`); the shared modules here (layers, presets, lora, moe,
tensor_parallel, ...) read a family's properties from it and never branch on a model_type themselves.

A family folder provides `FAMILY`, a family.Family with:
  - model_type, config_cls and the transformers classes the pipeline layers wrap (causal_lm, decoder_layer, norm,
    rotary);
  - presets: its model.preset names (family.Preset: config class, fields, description);
  - lora_targets: LoRA's default target_modules;
  - tp_attention_specs: AutoTP's layer specs of its attention (the MLP's are shared, in tensor_parallel.py);
  - moe_defaults and score_func (None for a dense family), has_router_bias, router_group_mask, has_mtp;
  - override_notes (why one of its config fields does not apply to another family), refusal (what the layers
    cannot run exactly, e.g. Qwen2's sliding-window layers) and run_refusals (the run options they cannot train
    exactly, e.g. V4's packing);
  - where its layers differ from the shared ones (layers.py calls these; None elsewhere): layer_kwargs (the decoder
    layer's keyword arguments: V4's two rotary tables and sliding-window mask, V3.2's 4-D mask), prepare_layer
    (its own initialisation and frozen parts: V4's hash tables, the indexers), streams_head and carries_token_ids
    (V4's hyper-connection streams and hash routing).
Adding a family is adding its folder and one line in registry.py. A family folder imports only transformers, family.py
and another family folder (deepseek_v3 reuses deepseek_v2's MLA pieces, qwen2 dense's), never the shared modules that
read the registry (an import cycle).
"""
