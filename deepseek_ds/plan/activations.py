"""Activation bytes: what autograd keeps from the forward of one micro-batch, per layer (how many micro-batches a
pipeline stage holds at once under each schedule: schedule_model.in_flight).

Per token, counted from what transformers' modules save for backward (checked against
torch.autograd.graph.saved_tensors_hooks in tests/test_plan.py): an RMSNorm keeps its input and rsqrt in fp32 and
its normalized output and the next matmul's input in the activation dtype; a linear layer its input; SiLU-gated MLPs
gate, up, act and down's input (4 x intermediate); attention q, k, v, the log-sum-exp and o_proj's input, and
MLA without a fused kernel (query and value head dims differ, CPU) the score matrix (heads x seq_len); a MoE layer
the router logits and, for each of the top-k routed copies of a token, its input, gate_up output, activation and
output. Activation checkpointing keeps only a checkpointed layer's input, and recomputes one layer at a time.
Without a fused kernel an attention block's backward also holds two more score matrices at once (the gradients of the
softmax's output and of the scores): a transient, once per rank, with the recomputed layer if checkpointed.
The loss: with ZeRO 0-2 a micro-batch of more than CHUNK_LOGITS / vocab tokens takes the chunked loss
(models/loss.py), which keeps the head's input and the targets and holds one chunk's logits at a time; otherwise the
full logits' fp32 log-softmax. DeepSeek-V4's layers (hyper-connection streams, compressed attention) are counted
in activations_v4.py, DeepSeek-V3.2's trainable indexers (indexer.stage warmup or sparse) in activations_v32.py. The
warm-up freezes everything but the indexers, so autograd keeps less of the other layers than training them does
(only what their inputs' gradients need): counted as trained, an upper bound.
"""

from __future__ import annotations

from ..models.layers import mtp_depth
from ..models.loss import CHUNK_LOGITS
from ..models.presets import is_moe
from ..models.registry import family_of
from . import activations_v4, activations_v32

FP32 = 4
INDEX_BYTES = 8  # int64 token ids and expert indices


def has_streams(mcfg) -> bool:
    """DeepSeek-V4: hc_mult residual streams between layers, and its own layers' activations."""
    return family_of(mcfg).streams_head is not None


def stream_width(mcfg) -> int:
    """Elements per token of what a decoder layer takes and gives: the hidden state, or V4's hc_mult streams."""
    return mcfg.hidden_size * (mcfg.hc_mult if has_streams(mcfg) else 1)


def _norm(width: int, f: int) -> int:
    """RMSNorm + the next matmul's input: fp32 input copy and rsqrt, normalized output and weighted output."""
    return FP32 * width + FP32 + 2 * f * width


def attention_bytes(mcfg, seq_len: int, f: int, tp: int, fused: bool, sp: int = 1) -> float:
    """Per token, one attention block including its input norm. `fused`: a flash / memory-efficient kernel (no score
    matrix kept); MLA's unequal query and value head dims fall back to the math kernel on the CPU. With sequence
    parallelism (sp > 1) per token of the rank's shard, seq_len the whole sequence's."""
    h = mcfg.num_attention_heads // tp
    out = _norm(mcfg.hidden_size, f)
    if hasattr(mcfg, "kv_lora_rank"):
        qk, v, rope, kv = (mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim, mcfg.v_head_dim, mcfg.qk_rope_head_dim,
                           mcfg.kv_lora_rank)
        if mcfg.q_lora_rank:
            out += _norm(mcfg.q_lora_rank, f) - f * mcfg.q_lora_rank
        out += f * (kv + rope) + FP32 + 2 * f * kv + 2 * rope * f
        out += f * h * (2 * qk + 2 * v) + FP32 * h if fused else f * h * (2 * qk + v + seq_len)
    else:
        d = mcfg.hidden_size // mcfg.num_attention_heads
        kvh = mcfg.num_key_value_heads // tp
        out += 2 * d * f + f * d * (h + 2 * kvh) + FP32 * h
    mla = hasattr(mcfg, "kv_lora_rank")
    # A fused kernel keeps its output for its backward, the same storage as o_proj's input; under SP the all-to-all
    # between them makes two (head-sharded and sequence-sharded), the same bytes each.
    outputs = 2 if sp > 1 and (fused or not mla) else 1
    return out + outputs * f * h * (v if mla else d)


def attention_work_bytes(mcfg, seq_len: int, f: int, tp: int, fused: bool) -> int:
    """Per token (of the rank's shard under SP, seq_len the whole sequence's), what one attention block's backward
    holds beside what its forward saved: without a fused kernel (MLA on the CPU, eager attention) the gradients of
    the softmax's output and of the scores, two score matrices (heads x seq_len each); a fused kernel works in tiles.
    Only MLA's and DeepSeek-V4's (eager only) score matrices are modelled: other attention takes a fused kernel here."""
    if has_streams(mcfg):
        return activations_v4.work_bytes(mcfg, seq_len, f)
    if fused or not hasattr(mcfg, "kv_lora_rank"):
        return 0
    return 2 * f * (mcfg.num_attention_heads // tp) * seq_len


def mlp_bytes(mcfg, moe: bool, f: int, tp: int, tiled: bool = False) -> float:
    """Per token, one MLP block including its input norm (dense, or shared + top-k routed experts). Tiled
    (train.tiled_mlp, models/tiled.py): the MLP keeps only its input, the norm's output counted already, and an
    MoE block its router's outputs (the router runs on the whole sequence)."""
    out = _norm(mcfg.hidden_size, f)
    if moe:
        out += router_bytes(mcfg, f)
    if tiled:
        return out
    if not moe:
        return out + 4 * f * mcfg.intermediate_size // tp
    k, inter = mcfg.num_experts_per_tok, mcfg.moe_intermediate_size
    out += f * k * (2 * mcfg.hidden_size + 4 * inter)
    return out + 4 * f * (mcfg.n_shared_experts or 0) * inter // tp


def router_bytes(mcfg, f: int) -> int:
    """Per token, what an MoE block's router keeps: its logits, their fp32 sigmoid (V3) or softmax (V2) scores, V3's
    group-limited choice mask, the top-k indices and weights and the token permutation."""
    k, e = mcfg.num_experts_per_tok, mcfg.n_routed_experts
    mask = e if family_of(mcfg).router_group_mask else 0
    return f * e + FP32 * e + mask + 5 * INDEX_BYTES * k


def layer_kinds(mcfg) -> list[str]:
    """"dense" or "moe" for each decoder layer."""
    first = getattr(mcfg, "first_k_dense_replace", mcfg.num_hidden_layers) if is_moe(mcfg) else mcfg.num_hidden_layers
    return ["dense" if i < first else "moe" for i in range(mcfg.num_hidden_layers)]


def spec_bytes(mcfg, seq_len: int, f: int, tp: int, fused: bool, sp: int = 1, tiled: bool = False,
               indexer: str = "frozen") -> list[float]:
    """Per token, the bytes each spec of models.pipeline.layer_specs keeps (embedding, decoder layers, norm, [MTP
    embedding and modules,] head), without checkpointing and without the loss. `indexer`: indexer.stage."""
    if has_streams(mcfg):
        return activations_v4.spec_bytes(mcfg, seq_len, f, tiled)
    attn = attention_bytes(mcfg, seq_len, f, tp, fused, sp)
    if activations_v32.trains(indexer):
        attn += activations_v32.indexer_bytes(mcfg, seq_len, f, indexer)
    layers = [attn + mlp_bytes(mcfg, kind == "moe", f, tp, tiled) for kind in layer_kinds(mcfg)]
    depth = mtp_depth(mcfg)
    # An MTP module: two norms, the projection of their concatenation, one MoE decoder layer.
    mtp = [2 * _norm(mcfg.hidden_size, f) + attn + mlp_bytes(mcfg, True, f, tp, tiled)] * depth if depth else []
    return [INDEX_BYTES, *layers, FP32 * mcfg.hidden_size + FP32 + f * mcfg.hidden_size,
            *([INDEX_BYTES] if depth else []), *mtp, f * mcfg.hidden_size]


def chunked_loss(mcfg, tokens: int, zero: int) -> bool:
    """Whether training projects the logits chunk by chunk (models.loss.linear_cross_entropy): not under ZeRO-3,
    which keeps the plain head (training/parallelize.py), nor for a micro-batch of at most one chunk."""
    return zero < 3 and tokens > CHUNK_LOGITS // mcfg.vocab_size


def loss_bytes(mcfg, f: int, chunked: bool) -> int:
    """Per token, what the cross-entropy keeps per predicted depth: chunked, the targets and the MTP depths' hidden
    states (the main one is the head's input, counted with the head); plain, the logits and their fp32 log-softmax."""
    depth = mtp_depth(mcfg)
    if chunked:
        return INDEX_BYTES * (1 + depth) + f * mcfg.hidden_size * depth
    return (f + FP32) * mcfg.vocab_size * (1 + depth)


def loss_chunk_bytes(mcfg, f: int) -> int:
    """The chunked loss's working chunk, forward and backward: its logits and their fp32 softmax."""
    return CHUNK_LOGITS // mcfg.vocab_size * mcfg.vocab_size * (FP32 + f)


def checkpointed(spec_index: int, interval: int, is_decoder: bool) -> bool:
    """SequentialLM's rule: decoder layer specs at an index divisible by the interval."""
    return bool(interval) and is_decoder and spec_index % interval == 0


def stage_micro_batch_bytes(mcfg, bounds: list[int], stage: int, tokens: int, seq_len: int, f: int, tp: int,
                            fused: bool, interval: int, with_loss: bool, zero: int, sp: int = 1,
                            tiled_mlp: int = 0, indexer: str = "frozen") -> tuple[int, int]:
    """(bytes one micro-batch of `tokens` tokens leaves saved on a stage after its forward, the transient bytes once
    per rank, not per micro-batch: the largest checkpointed layer while backward recomputes it plus an unfused
    attention's working score matrices or a trainable indexer's working query block, one MLP tile's recomputation
    (tiled_mlp: tokens per tile) or the chunked loss's working chunk). `indexer`: indexer.stage."""
    per_spec = spec_bytes(mcfg, seq_len, f, tp, fused, sp, tiled=tiled_mlp > 0, indexer=indexer)
    layers, depth = mcfg.num_hidden_layers, mtp_depth(mcfg)
    decoder = set(range(1, layers + 1))
    attends = decoder | set(range(layers + 3, layers + 3 + depth))  # decoder layers and MTP modules
    mine = range(bounds[stage], bounds[stage + 1])
    saved, recompute = 0.0, 0.0
    for i in mine:
        if checkpointed(i, interval, i in decoder):
            saved += f * stream_width(mcfg)  # the layer's input, kept for the recomputation
            recompute = max(recompute, per_spec[i])
        else:
            saved += per_spec[i]
    # A layer's backward: its recomputed activations (if checkpointed) and its attention's working score matrices.
    work = attention_work_bytes(mcfg, seq_len, f, tp, fused) if attends.intersection(mine) else 0
    transient = int((recompute + work) * tokens)
    if activations_v32.trains(indexer) and attends.intersection(mine):  # a layer's indexer, then its attention
        transient = max(transient, int(recompute * tokens) + activations_v32.work_bytes(
            mcfg, max(1, tokens // seq_len), seq_len, f))
    if tiled_mlp:  # a tile's MLP activations, whole, while backward recomputes it
        kinds = set(layer_kinds(mcfg))
        mlp = (activations_v4.mlp_bytes(mcfg, f) if has_streams(mcfg)
               else max(mlp_bytes(mcfg, k == "moe", f, tp) for k in kinds))
        transient = max(transient, int(mlp * min(tiled_mlp, tokens)))
    if with_loss and stage == len(bounds) - 2:
        chunked = chunked_loss(mcfg, tokens, zero)
        saved += loss_bytes(mcfg, f, chunked)
        if chunked:  # the loss's chunk and a layer's recomputation come one after the other in the backward
            transient = max(transient, loss_chunk_bytes(mcfg, f))
    return int(saved * tokens), transient
