"""Activation bytes of DeepSeek-V3.2's trainable lightning indexer (indexer.stage warmup or sparse,
models/deepseek_v32/indexer.py), counted from what autograd keeps (checked against
torch.autograd.graph.saved_tensors_hooks in tests/test_plan_v32.py). A frozen indexer (the default) runs under no_grad
and keeps nothing.

Per token and DSA layer: the indexer reads detached inputs, whose storage the attention keeps already (its input and
q_resid); it adds its key projection's LayerNorm input and statistics, the rotated queries [H_I x D] and keys [D] and
the fp32 head weights [H_I], which the query blocks' checkpoints keep, and each block's other checkpoint inputs, views
of what the layer computed once: the main attention's queries and keys [heads x qk_head_dim each, recomputed without
gradient for p], the chosen keys (int32, index_topk, sparse stage) and the counted-query flags (fp32). Neither p nor
any [B, S, H_I, T] score tensor is kept: a block's backward recomputes them (the attention mask they read is the
stage's, kept by transformers' layers anyway).

Transient, once per rank: the backward of one query block holds WORK_BLOCKS fp32 score blocks [B, rows, H_I, T] at
once (the recomputed ReLU scores and their gradients), rows as the indexer chooses them (its chunk_elements over
B x heads x T); its forward the main attention's queries and keys, recomputed whole for p, beside one block's
head-wise probabilities (PROBABILITY_BLOCKS blocks of [B, heads, rows, T]).
"""

from __future__ import annotations

from ..models.deepseek_v32.indexer import TrainableIndexer

FP32 = 4
WORK_BLOCKS = 3       # a block's backward: the ReLU scores, the gradient reaching them and the one leaving the ReLU
PROBABILITY_BLOCKS = 3  # p of a block: the heads' scores, their masked copy and softmax


def trains(stage: str) -> bool:
    """indexer.stage warmup or sparse: the indexer has a forward that autograd records."""
    return stage != "frozen"


def indexer_bytes(mcfg, seq_len: int, f: int, stage: str = "sparse") -> int:
    """Per token, what one trainable indexer keeps for its backward (the module docstring's list)."""
    d, heads = mcfg.index_head_dim, mcfg.index_n_heads
    projections = f * d + 2 * FP32 + f * heads * d + f * d + FP32 * heads  # k_norm input, mean, rstd; q; k; weights
    main = 2 * f * mcfg.num_attention_heads * (mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim)
    chosen = FP32 * min(mcfg.index_topk, seq_len) if stage == "sparse" else 0  # int32 indices
    return projections + main + chosen + FP32  # and the counted flag


def block_rows(mcfg, batch: int, seq_len: int) -> int:
    """Queries per block, as TrainableIndexer.forward chooses them (training: over the index and attention heads)."""
    heads = max(mcfg.index_n_heads, mcfg.num_attention_heads)
    return max(1, TrainableIndexer.chunk_elements // (batch * heads * seq_len))


def work_bytes(mcfg, batch: int, seq_len: int, f: int) -> int:
    """Bytes one trainable indexer holds for a moment beyond what it keeps, the larger of its forward's and its
    backward's (a micro-batch of `batch` sequences of seq_len tokens)."""
    rows = min(block_rows(mcfg, batch, seq_len), seq_len)
    backward = WORK_BLOCKS * FP32 * batch * rows * mcfg.index_n_heads * seq_len
    heads = mcfg.num_attention_heads
    qk = mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim
    # The queries and keys; in a bf16 / fp16 layer also the keys' fp32 copy each block's scores are taken against.
    queries_keys = (2 * f + (FP32 if f != FP32 else 0)) * batch * seq_len * heads * qk
    forward = queries_keys + PROBABILITY_BLOCKS * FP32 * batch * rows * heads * seq_len
    return max(backward, forward)
