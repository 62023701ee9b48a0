"""Between our pipeline layers and Hugging Face models / directories.

In memory our tensors carry transformers' own (fused-expert) layout, so the mapping is only a renaming;
transformers' save_pretrained / from_pretrained convert between that layout and the per-expert tensors of
the published checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import DecoderLayerPipe, EmbeddingPipe, family_of, hf_key


def hf_state_dict(layers) -> dict[str, torch.Tensor]:
    """HF (in-memory) names -> tensors for an iterable of pipeline layers; buffers such as the router's
    e_score_correction_bias included, non-persistent ones (rotary inv_freq) not."""
    out = {}
    for layer in layers:
        for key, tensor in layer.state_dict().items():
            if isinstance(layer, DecoderLayerPipe) and key.startswith("rotary."):
                continue
            out[hf_key(layer, key)] = tensor
    return out


def to_hf_model(layers, config) -> nn.Module:
    """A transformers CausalLM holding (sharing) the weights of the given layers."""
    sd = hf_state_dict(layers)
    if getattr(config, "tie_word_embeddings", False):
        sd["lm_head.weight"] = next(l for l in layers if isinstance(l, EmbeddingPipe)).embed_tokens.weight
    with torch.device("meta"):
        model = family_of(config).causal_lm(config)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise KeyError(f"weights do not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # Non-persistent buffers (rotary tables) were left on meta: rebuild them on the CPU.
    for name, module in model.named_modules():
        if hasattr(module, "inv_freq") and module.inv_freq.device.type == "meta":
            fresh = type(module)(config)
            module.inv_freq = fresh.inv_freq
            module.original_inv_freq = fresh.original_inv_freq
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()
