"""Training FLOPs per token: the one formula behind the pipeline partition's compute share and the metrics'
TFLOP/s and MFU.

Per token, a layer costs 6 x the parameters it touches (2 forward, 4 backward: the PaLM / Megatron-LM
accounting; an MoE layer touches only its top-k routed experts) plus, for attention layers, the score and value
matmuls, which have no parameters. The parameter counts come from `pipeline.layer_costs`, which builds every
layer on the meta device; this module only does the arithmetic, so the two users cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layers import mtp_depth


@dataclass(frozen=True)
class LayerCost:
    name: str
    params: int             # all parameters the stage must hold
    active_params: int      # parameters touched per token (one MoE layer uses only top-k routed experts)
    attention: bool = False  # a decoder layer or MTP module: adds the attention matmuls


def attention_flops(config, seq_len: int) -> int:
    """One layer's attention score (q.k) and value (p.v) matmuls per token: 2 x heads x seq_len x (qk + v head
    dims) forward, x3 with backward, halved because the causal mask leaves half the square. MLA's query/key head
    has a no-position and a rotary part and its value head a size of its own."""
    if hasattr(config, "qk_nope_head_dim"):
        qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        # As Llama and Qwen2 attention size their heads (GQA shares K/V heads, but every query head scores).
        qk = v = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * config.num_attention_heads * seq_len * (qk + v) // 2


def layer_flops(costs: list[LayerCost], config, seq_len: int) -> list[int]:
    """Training FLOPs per token of each layer of `costs` (the spec list's order, the head last). The head runs
    once for the main model and once more for every MTP depth, all through the same weights."""
    attn = attention_flops(config, seq_len)
    out = [6 * c.active_params + (attn if c.attention else 0) for c in costs]
    out[-1] *= 1 + mtp_depth(config)
    return out


def per_token(costs: list[LayerCost], config, seq_len: int) -> int:
    """Training FLOPs per token of the whole model (every layer, MTP modules included)."""
    return sum(layer_flops(costs, config, seq_len))
