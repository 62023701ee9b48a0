"""Training FLOPs per token: the one formula behind the pipeline partition's compute share and the metrics'
TFLOP/s and MFU.

Per token, a layer costs 6 x the parameters it touches (2 forward, 4 backward: the PaLM / Megatron-LM
accounting; an MoE layer touches only its top-k routed experts) plus, for attention layers, the score and value
matmuls, which have no parameters. The parameter counts come from `pipeline.layer_costs`, which builds every
layer on the meta device; this module only does the arithmetic, so the two users cannot drift apart.

DeepSeek-V4 attends in transformers' eager kernel, which computes the whole masked score matrix: every query
against every position of the sequence and every compressed entry of its layer (none for sliding-window layers,
seq_len / compress_rate for CSA and HCA), not the causal half nor the window. Its lightning indexers are frozen and
their output is top-k indices: their projections and scores run forward only (2 FLOPs per weight, none backward).
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


def attention_flops(config, seq_len: int, kind: str | None = None) -> int:
    """One layer's attention score (q.k) and value (p.v) matmuls per token: 2 x heads x seq_len x (qk + v head
    dims) forward, x3 with backward, halved because the causal mask leaves half the square. MLA's query/key head
    has a no-position and a rotary part and its value head a size of its own. DeepSeek-V4 (`kind`: the layer's
    layer_types entry): the whole square and the layer's compressed entries, and a CSA layer's indexer."""
    if hasattr(config, "compress_rates"):
        return _v4_attention_flops(config, seq_len, kind)
    if hasattr(config, "qk_nope_head_dim"):
        qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        # As Llama and Qwen2 attention size their heads (GQA shares K/V heads, but every query head scores).
        qk = v = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * config.num_attention_heads * seq_len * (qk + v) // 2


def _v4_attention_flops(config, seq_len: int, kind: str) -> int:
    entries = seq_len // config.compress_rates[kind] if kind in config.compress_rates else 0
    out = 6 * config.num_attention_heads * (seq_len + entries) * 2 * config.head_dim
    if kind == "compressed_sparse_attention":
        # The indexer: its scores over the entries, and 2 FLOPs per weight of its projections (kv and gate to two
        # index heads' width each, q_b from the query's latent, the per-head weights) instead of the 6 counted.
        h, d = config.index_n_heads, config.index_head_dim
        weights = 4 * config.hidden_size * d + config.q_lora_rank * h * d + config.hidden_size * h
        out += 2 * h * d * entries - 4 * weights
    return out


def _attention_kinds(config) -> list[str | None]:
    """Per decoder layer and MTP module, in order: its attention kind (DeepSeek-V4's layer_types) or None."""
    n = config.num_hidden_layers + mtp_depth(config)
    return list(getattr(config, "layer_types", None) or [None] * n)[:n] if hasattr(config, "compress_rates") \
        else [None] * n


def layer_flops(costs: list[LayerCost], config, seq_len: int) -> list[int]:
    """Training FLOPs per token of each layer of `costs` (the spec list's order, the head last). The head runs
    once for the main model and once more for every MTP depth, all through the same weights."""
    kinds = iter(_attention_kinds(config))
    out = [6 * c.active_params + (attention_flops(config, seq_len, next(kinds)) if c.attention else 0)
           for c in costs]
    out[-1] *= 1 + mtp_depth(config)
    return out


def per_token(costs: list[LayerCost], config, seq_len: int) -> int:
    """Training FLOPs per token of the whole model (every layer, MTP modules included)."""
    return sum(layer_flops(costs, config, seq_len))


def model_size(costs: list[LayerCost]) -> tuple[int, int]:
    """(parameters, parameters a token's matmuls touch) of a whole model from its layer costs, each weight once:
    the copy of the embedding that the MTP modules' stage holds ("MTPEmbed(tied)") is the model's own. MTP modules
    count; buffers (V3's routing biases, V4's hash tables) do not; active counts the top-k routed experts, the head
    and not the embedding lookup."""
    shared = sum(c.params for c in costs if c.name == "MTPEmbed(tied)")
    return sum(c.params for c in costs) - shared, sum(c.active_params for c in costs)
