"""Activation bytes of DeepSeek-V4's layers per token, counted from what transformers' deepseek_v4 modules save for
backward (checked against torch.autograd.graph.saved_tensors_hooks in tests/test_plan_v4.py):

- the residual is hc_mult streams: each hyper-connection keeps its flattened fp32 streams, their norm and the
  Sinkhorn iterations' quotients (hc x hc each), and the layer's mixing keeps post, comb and the block's output;
- attention is eager over the whole sequence: the probabilities [heads, seq_len + entries + 1 sink] per token,
  the one KV head expanded to every head for keys and values (with the compressed entries), q, and the grouped
  output projection's inputs; a compressed layer (CSA every compress_rates[csa] tokens, HCA every [hca]) its
  compressor's windows and gate softmax; CSA's lightning indexer (frozen, but fed by trainable activations, so
  autograd keeps its forward) its own windows and the scorer's per-query copy of the compressed keys
  [index_head_dim x entries] and scores [index heads x entries];
- an MoE layer: the router's scores (sqrt-softplus) and picks; for each routed copy of a token in the grouped_mm
  kernel (model.experts_implementation's default) its permutation indices, input, gate_up output, the clamps'
  masks and activation, its weight and weighted output; the shared experts' clamped SwiGLU.
Where the modules compute in fp32 inside a bf16 layer they keep fp32 copies beside the bf16 tensors.
"""

from __future__ import annotations

FP32 = 4
INDEX_BYTES = 8
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def streams(mcfg) -> int:
    return int(mcfg.hc_mult)


def entries(mcfg, kind: str, seq_len: int) -> int:
    """Compressed KV entries a layer of `kind` attends to beside the sequence (none for sliding-window layers)."""
    return seq_len // mcfg.compress_rates[kind] if kind in (CSA, HCA) else 0


def _low(width: int, f: int) -> int:
    """A bf16 / fp16 tensor kept beside its fp32 copy (one and the same tensor in an fp32 layer)."""
    return f * width if f != FP32 else 0


def _fp32(width: int, f: int) -> int:
    """The fp32 copy an fp32 computation keeps of a bf16 / fp16 tensor (none in an fp32 layer)."""
    return FP32 * width if f != FP32 else 0


def _norm(width: int, f: int) -> int:
    """V4's RMSNorm (fp32 weight): its fp32 input and normalized output, rsqrt, and its output as the next input."""
    return 2 * FP32 * width + FP32 + f * width


def hyper_connection_bytes(mcfg, f: int) -> int:
    """One hyper-connection (attention's or the MLP's): the flattened fp32 streams and their normed copy (the
    projection's input), rsqrt, pre / post / comb's sigmoids and softmax, Sinkhorn's 2 x iterations - 1 divisions
    (comb and its sums each), the collapse's weights and, in a bf16 layer, the bf16 streams themselves."""
    hc, d = streams(mcfg), mcfg.hidden_size
    sinkhorn = (2 * mcfg.hc_sinkhorn_iters - 1) * (hc * hc + hc)
    return FP32 * (2 * hc * d + 1 + sinkhorn + 5 * hc + 2 * hc * hc) + _low(hc * d, f)


def attention_bytes(mcfg, kind: str, seq_len: int, f: int) -> float:
    """One attention block of a layer of `kind`, its input norm included."""
    d, h, hd, ql = mcfg.hidden_size, mcfg.num_attention_heads, mcfg.head_dim, mcfg.q_lora_rank
    rope, e = mcfg.qk_rope_head_dim, entries(mcfg, kind, seq_len)
    out = _norm(d, f) + 2 * FP32 * ql + FP32 + f * ql  # input norm; q_a_norm and q_residual
    out += f * h * (hd + 1) + _fp32(h * (hd + 1), f) + 2 * FP32 * hd + FP32  # q_b_norm (unweighted), kv_norm
    out += 6 * f * rope  # cos and sin of q's, kv's and the output's rotations
    # q; the KV head expanded to every head for keys and for values; the max's indices; the probabilities.
    out += f * h * hd + 2 * f * h * hd * (seq_len + e) / seq_len + INDEX_BYTES * h + f * h * (seq_len + e + 1)
    out += f * h * hd + f * mcfg.o_groups * mcfg.o_lora_rank  # the grouped output projection's inputs
    if not e:
        return out
    # The compressor: CSA's overlapping windows hold two series (2 x head_dim per token), HCA's one; per entry
    # its norm and rotation.
    w = hd * (2 if kind == CSA else 1)
    out += f * w + FP32 * w + _low(w, f) + (2 * FP32 * hd + FP32 + 2 * f * rope) * e / seq_len
    if kind == CSA:
        return out + indexer_bytes(mcfg, seq_len, f)
    return out


def indexer_bytes(mcfg, seq_len: int, f: int) -> float:
    """CSA's lightning indexer: its compressor's windows (frozen norm: input and rsqrt), the query's rotation, the
    scorer's fp32 query, per-query copy of the compressed keys, ReLU scores and weighted scores, weights, the
    future mask and the top-k picks."""
    di, hi, rope = mcfg.index_head_dim, mcfg.index_n_heads, mcfg.qk_rope_head_dim
    e = entries(mcfg, CSA, seq_len)
    out = f * 2 * di + FP32 * 2 * di + _low(2 * di, f) + (FP32 * di + FP32 + 2 * f * rope) * e / seq_len
    out += 2 * f * rope + FP32 * (hi * di + di * e + 2 * hi * e + hi) + e + INDEX_BYTES * min(mcfg.index_topk, e)
    return out


def mlp_bytes(mcfg, f: int, tiled: bool = False) -> float:
    """One MoE block (hash-routed or top-k: the same tensors), its input norm included. Tiled (train.tiled_mlp):
    the norm and the router only."""
    d, inter, k, n = mcfg.hidden_size, mcfg.moe_intermediate_size, mcfg.num_experts_per_tok, mcfg.n_routed_experts
    # The router: its scores, picks and normalised weights, and in a bf16 layer their fp32 copies and its input's.
    out = _norm(d, f) + 2 * f * n + INDEX_BYTES * k + f * (k + 1) + _fp32(d + 2 * n + k + 1, f)
    if tiled:
        return out
    out += k * (3 * INDEX_BYTES + 2 * f * d + 6 * f * inter + f)  # each routed copy, grouped_mm
    return out + 6 * f * (mcfg.n_shared_experts or 0) * inter  # clamped SwiGLU: gate, up, their clamps, act


def decoder_bytes(mcfg, kind: str, seq_len: int, f: int, tiled: bool = False) -> float:
    """One decoder layer: two hyper-connections, attention, MLP, and the mixing of each block's output into the
    streams (post, comb and the output, each in the layer's dtype)."""
    hc, d = streams(mcfg), mcfg.hidden_size
    mixing = 2 * f * (hc + d + hc * hc)
    return (2 * hyper_connection_bytes(mcfg, f) + attention_bytes(mcfg, kind, seq_len, f) + mixing
            + mlp_bytes(mcfg, f, tiled))


def final_norm_bytes(mcfg, f: int) -> int:
    """FinalNormPipe: the streams' head (hyper-connection-like, without Sinkhorn) and the final RMSNorm."""
    hc, d = streams(mcfg), mcfg.hidden_size
    return FP32 * (2 * hc * d + 1 + 3 * hc) + _low(hc * d, f) + 2 * FP32 * d + FP32


def spec_bytes(mcfg, seq_len: int, f: int, tiled: bool = False) -> list[float]:
    """Per token, each spec of models.pipeline.layer_specs (embedding with its carried ids, decoder layers, final
    norm, head)."""
    layers = [decoder_bytes(mcfg, kind, seq_len, f, tiled) for kind in mcfg.layer_types[:mcfg.num_hidden_layers]]
    return [INDEX_BYTES, *layers, final_norm_bytes(mcfg, f), f * mcfg.hidden_size]


def work_bytes(mcfg, seq_len: int, f: int) -> int:
    """Per token, what eager attention's backward holds beside the saved tensors: the gradients of the
    probabilities and of the scores, over the sequence and the most compressed entries of any layer."""
    most = max(entries(mcfg, kind, seq_len) for kind in mcfg.layer_types[:mcfg.num_hidden_layers])
    return 2 * f * mcfg.num_attention_heads * (seq_len + most + 1)
