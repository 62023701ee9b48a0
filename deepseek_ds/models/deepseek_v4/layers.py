"""What DeepSeek-V4's layers need around transformers' modules in a pipeline stage (the shared pipeline layers,
models/layers.py, call these through the family record):

- the decoder layer's keyword arguments: its two rotary tables (`main` for sliding-window layers, `compress` for the
  compressed ones), the sliding-window causal mask (built once per stage and micro-batch) and the input ids, which
  the hash-routed MoE layers look their experts up by wherever a split puts them;
- the initialisation transformers gives the parameters that do not follow normal(0, std), and a hash table;
- the frozen lightning indexers, and routers that score in fp32 under bf16.
"""

from __future__ import annotations

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from ..family import cached_on

ROPE_KINDS = ("main", "compress")
# transformers' V4 initialisation of the parameters that do not follow normal(0, std): zeros for the attention sinks,
# the compressors' position biases and the hyper-connections' biases, ones for their scales.
_ZERO_INIT = ("sinks", "position_bias", "base", "hc_base")
_ONE_INIT = ("scale", "hc_scale")


def hash_table(vocab_size: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """A hash MoE layer's frozen token -> experts table (tid2eid): top_k distinct experts per token, drawn uniformly
    from the layer's seed. transformers zero-initialises it (every token on expert 0) because the released weights
    carry the real one; a model trained from scratch needs a table that spreads the vocabulary over the experts."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(vocab_size, num_experts, generator=gen).argsort(-1)[:, :top_k].contiguous()


def prepare_layer(module: nn.Module, seed: int | None) -> None:
    """After the shared initialisation (seed given: a model trained from scratch), V4's own; always, the indexers
    frozen: they pick their entries by top-k (integer indices), so no gradient reaches them (no optimizer state, no
    weight decay) until an indexer loss trains them."""
    if seed is not None:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0), torch.no_grad():
            for name, p in module.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if p.device.type != "meta" and leaf in _ZERO_INIT + _ONE_INIT:
                    p.fill_(0.0 if leaf in _ZERO_INIT else 1.0)
        for m in module.modules():
            if isinstance(m, v4.DeepseekV4HashRouter) and m.tid2eid.device.type != "meta":
                m.tid2eid.copy_(hash_table(m.tid2eid.shape[0], m.num_experts, m.top_k, seed))
    for m in module.modules():
        if isinstance(m, v4.DeepseekV4Indexer):
            m.requires_grad_(False)
        if isinstance(m, (v4.DeepseekV4TopKRouter, v4.DeepseekV4HashRouter)):
            m.register_forward_hook(_route_in_fp32)


def _route_in_fp32(router: nn.Module, args: tuple, output: tuple):
    """DeepSeek scores its experts in fp32 (its V4 code; transformers' V3 router too), transformers' V4 router in the
    weight's dtype: under bf16 its choices would drift. Written here because transformers has no fp32 V4 router:
    the same formula recomputed in fp32 (the fp32 correction bias included) whenever the weight is not fp32."""
    if router.weight.dtype == torch.float32:
        return None
    hidden = args[0]
    logits = F.linear(hidden.reshape(-1, router.hidden_dim).float(), router.weight.float())
    scores = router.score_fn(logits)
    if isinstance(router, v4.DeepseekV4HashRouter):
        indices = router.tid2eid[args[1].reshape(-1)].long()
    else:
        biased = scores + router.e_score_correction_bias.float()
        indices = torch.topk(biased, router.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, (weights * router.routed_scaling_factor).to(hidden.dtype), indices


def layer_kwargs(config, rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                 input_ids: torch.Tensor) -> dict:
    """The keyword arguments of transformers' DeepseekV4DecoderLayer, as DeepseekV4Model passes them."""
    tables = {kind: rotary(hidden, position_ids, layer_type=kind) for kind in ROPE_KINDS}
    return {"input_ids": input_ids, "position_embeddings": tables, "position_ids": position_ids,
            "attention_mask": _sliding_window_mask(config, hidden, position_ids), "cache": None}


def _sliding_window_mask(config, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Every V4 layer kind uses it (the compressed entries get their own causal bias inside attention)."""
    return cached_on(position_ids, ("sliding_window", hidden.dtype), lambda: create_sliding_window_causal_mask(
        config=config, inputs_embeds=hidden[:, :, 0], attention_mask=None, cache=None, position_ids=position_ids))
