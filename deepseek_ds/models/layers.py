"""Pipeline-stage layers built from transformers' own DeepSeek / Llama modules.

Only `(hidden_states, position_ids)` travels between stages; every decoder layer rebuilds its rotary
embedding locally (it has no parameters). Each layer knows the HF name prefix of its weights, which is
what lets a stage read and write exactly its own tensors of an HF directory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
from transformers.models.llama import modeling_llama as llama


@dataclass(frozen=True)
class Family:
    causal_lm: type
    decoder_layer: type
    norm: type
    rotary: type


FAMILIES = {
    "deepseek_v3": Family(v3.DeepseekV3ForCausalLM, v3.DeepseekV3DecoderLayer, v3.DeepseekV3RMSNorm, v3.DeepseekV3RotaryEmbedding),
    "deepseek_v2": Family(v2.DeepseekV2ForCausalLM, v2.DeepseekV2DecoderLayer, v2.DeepseekV2RMSNorm, v2.DeepseekV2RotaryEmbedding),
    "llama": Family(llama.LlamaForCausalLM, llama.LlamaDecoderLayer, llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding),
}


def family_of(config) -> Family:
    return FAMILIES[config.model_type]


def init_weights_(module: nn.Module, std: float, seed: int) -> None:
    """Initialise one layer from its own seed, so that the initial model does not depend on how layers are split
    into stages or which rank builds them. Written by hand because transformers initialises a whole model from
    the global RNG; the distribution is the same as its `_init_weights` (normal(0, std), norms 1, biases 0)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        with torch.no_grad():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif leaf == "bias":
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias") and b.device.type != "meta":
            b.zero_()


class EmbeddingPipe(nn.Module):
    hf_prefix = "model."

    def __init__(self, config, seed: int | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        if seed is not None:
            init_weights_(self, config.initializer_range, seed)

    def forward(self, input_ids: torch.Tensor):
        hidden = self.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        return hidden, position_ids.contiguous()

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head: logits from the embedding matrix."""
        return nn.functional.linear(hidden, self.embed_tokens.weight)


class DecoderLayerPipe(nn.Module):
    def __init__(self, config, layer_idx: int, seed: int | None = None):
        super().__init__()
        fam = family_of(config)
        self.hf_prefix = f"model.layers.{layer_idx}."
        self.layer_idx = layer_idx
        self.layer = fam.decoder_layer(config, layer_idx)
        self.rotary = fam.rotary(config)
        if seed is not None:
            init_weights_(self, config.initializer_range, seed)

    def hf_key(self, local_key: str) -> str:
        return self.hf_prefix + local_key.removeprefix("layer.")

    def forward(self, inputs):
        hidden, position_ids = inputs
        position_embeddings = self.rotary(hidden, position_ids)
        # attention_mask=None: SDPA/flash take their causal path, identical to transformers' own mask-free path.
        hidden = self.layer(hidden, attention_mask=None, position_ids=position_ids,
                            position_embeddings=position_embeddings)
        return hidden, position_ids


class FinalNormPipe(nn.Module):
    hf_prefix = "model."

    def __init__(self, config, seed: int | None = None):
        super().__init__()
        self.norm = family_of(config).norm(config.hidden_size, eps=config.rms_norm_eps)
        if seed is not None:
            init_weights_(self, config.initializer_range, seed)

    def forward(self, inputs):
        hidden, _position_ids = inputs
        return self.norm(hidden)


class LMHeadPipe(nn.Module):
    hf_prefix = ""

    def __init__(self, config, seed: int | None = None):
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if seed is not None:
            init_weights_(self, config.initializer_range, seed)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def hf_key(layer: nn.Module, local_key: str) -> str:
    """The HF checkpoint name of a parameter/buffer of one pipeline layer."""
    if isinstance(layer, DecoderLayerPipe):
        return layer.hf_key(local_key)
    return layer.hf_prefix + local_key


def tied_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.project(hidden)
