"""DeepSeek-V3.2's lightning indexer made trainable (V3.2 report, sec. 2.1.1), which transformers' module is not: its
forward runs under no_grad. indexer.stage (config/schema.py):
- warmup: attention stays dense and the indexer learns to match it: for each query t, KL(p_t || softmax(I_t)) over the
  causal keys, p_t the main attention's probabilities summed over its heads and L1-normalised;
- sparse: attention keeps the indexer's top-k keys S_t, and the indexer learns KL(p_t,S_t || softmax(I_t,S_t)) over
  those only.
In both the indexer reads detached inputs and p_t is a constant: the indexer learns only from its loss and nothing
else from it. transformers has no trainable indexer (nor does DeepSpeed): its scoring formula is written again here
with gradients, a block of queries at a time, so that neither the indexer's [B, S, H_I, T] scores nor the main
attention's [B, H, S, T] probabilities exist whole (each block's scores are recomputed in the backward)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

from ..loss import CHUNK_LOGITS

STAGES = ("frozen", "warmup", "sparse")


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' DeepseekV32Indexer score of a block of queries: sum_h weights[b,s,h] relu(scale q[b,s,h].k[b,t]),
    fp32. q [B, c, H_I, D] (rotated), k [B, T, D], weights [B, c, H_I] (weights_proj x H_I^-0.5) -> [B, c, T]."""
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def _kl_sum(q, k, weights, scale: float, p, keep, counted) -> torch.Tensor:
    """sum over counted queries of KL(p_t || softmax of the index scores over the keys `keep`) (p is 0 elsewhere)."""
    logits = index_scores(q, k, weights, scale).masked_fill(~keep, float("-inf"))
    log_q = torch.log_softmax(logits, dim=-1).masked_fill(~keep, 0.0)
    kl = (torch.xlogy(p, p) - p * log_q).sum(-1)
    return (kl * counted).sum()


def _block_kl(q, k, weights, scale: float, attn_scaling: float, query, key, mask, chosen, counted) -> torch.Tensor:
    """_kl_sum of a block of queries with p_t and its keys built here from what the layer holds anyway (the main
    queries and keys, the attention mask, the chosen keys or None: every causal key), so that a checkpoint of it
    keeps no [B, c, T] tensor of its own: the backward recomputes them."""
    keep = mask if mask.dtype == torch.bool else mask == 0
    if chosen is not None:
        keep = keep & torch.zeros_like(keep).scatter_(-1, chosen.long(), True)
    with torch.no_grad():
        p = attention_probabilities(attn_scaling, query, key, keep)
    return _kl_sum(q, k, weights, scale, p, keep, counted)


def attention_probabilities(scaling: float, query: torch.Tensor, key: torch.Tensor, keep: torch.Tensor
                            ) -> torch.Tensor:
    """p_t of a block of queries: the main attention's softmax over the keys `keep` [B, c, T] (query [B, H, c, d],
    key [B, H, T, d], the attention's `scaling`), summed over the heads and divided by its sum, fp32 [B, c, T]."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    probs = torch.softmax(scores.masked_fill(~keep.unsqueeze(1), float("-inf")), dim=-1).sum(1)
    return probs / probs.sum(-1, keepdim=True)


def main_queries_keys(attn: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, position_embeddings):
    """The main attention's queries and keys [B, H, S, d] as transformers' DeepseekV32Attention computes them."""
    b, s = hidden.shape[:2]
    q = attn.q_b_proj(q_resid).view(b, s, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_pass = attn.kv_a_layernorm(kv_pass).view(b, 1, s, attn.kv_lora_rank)
    q_rot, k_rot = v32.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, s, attn.qk_rope_head_dim),
                                                       *position_embeddings)
    key, _ = attn.expand_kv(k_pass, k_rot)
    return torch.cat((q_pass, q_rot), dim=-1), key


class TrainableIndexer(v32.DeepseekV32Indexer):
    """transformers' indexer (same parameters and names, so checkpoints and exports do not change) computing its
    selection as transformers does, and in training also its KL loss, left in `kl_sum` (the sum over the counted
    queries, with a gradient to the indexer's parameters only) for IndexerLoss to add to the backward. Becomes one
    by train_indexers(); `query_mask` [B, S] (the queries with a target) is set before each call by IndexerLoss."""
    stage = "sparse"
    chunk_elements = CHUNK_LOGITS  # the largest fp32 block of scores a query block may hold
    query_mask: torch.Tensor | None = None
    kl_sum: torch.Tensor | None = None

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
        if cache is not None:
            raise ValueError("a trainable DeepSeek-V3.2 indexer keeps no cache: generate with the exported model")
        b, s, _ = hidden_states.shape
        t = attention_mask.shape[-1]
        # The indexer learns from detached inputs: its loss reaches nothing else.
        q, k, weights = self._project(hidden_states.detach(), q_resid.detach(), position_embeddings)
        learns = self.training
        if learns:
            with torch.no_grad():
                query, key = main_queries_keys(self.main_attention(), hidden_states, q_resid, position_embeddings)
            heads = max(self.n_heads, query.shape[1])
            counted = (torch.ones(b, s, device=q.device) if self.query_mask is None
                       else (self.query_mask != 0).float())
        else:
            heads = self.n_heads
        rows = max(1, self.chunk_elements // (b * heads * t))
        topk = min(self.index_topk, t)
        selected = None if self.stage == "warmup" else torch.empty(b, s, topk, dtype=torch.int32, device=q.device)
        total = None
        blocks = [slice(a, a + rows) for a in range(0, s, rows)]
        for block in blocks if selected is not None else ():
            with torch.no_grad():
                scores = index_scores(q[:, block], k, weights[:, block], self.softmax_scale)
                # As transformers masks: -inf for a boolean mask, the additive mask otherwise.
                scores = (scores.masked_fill(~attention_mask[:, block], float("-inf"))
                          if attention_mask.dtype == torch.bool else scores + attention_mask[:, block])
                selected[:, block] = scores.topk(topk, dim=-1).indices.to(torch.int32)
        for block in blocks if learns else ():
            # Its inputs are views of tensors the layer holds (no copy is kept): O(S) of its own, not O(S T).
            part = checkpoint(_block_kl, q[:, block], k, weights[:, block], self.softmax_scale,
                              self.main_attention().scaling, query[:, :, block], key, attention_mask[:, block],
                              None if selected is None else selected[:, block], counted[:, block],
                              use_reentrant=False)
            total = part if total is None else total + part
        self.kl_sum = total
        if selected is None:  # dense attention: every key selected (the causal mask still applies)
            return torch.arange(t, dtype=torch.int32, device=q.device).expand(b, s, t)
        return selected

    def _project(self, hidden, q_resid, position_embeddings):
        """transformers' indexer projections: rotated queries [B, S, H_I, D] and keys [B, S, D], head weights."""
        b, s, _ = hidden.shape
        cos, sin = position_embeddings
        rope = self.qk_rope_head_dim
        q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
        q_rot, q_pass = torch.split(q, [rope, self.head_dim - rope], dim=-1)
        k = self.k_norm(self.wk(hidden)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [rope, self.head_dim - rope], dim=-1)
        q_rot, k_rot = v32.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        weights = self.weights_proj(hidden.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2), weights


def train_indexers(model: nn.Module, stage: str) -> int:
    """indexer.stage warmup or sparse on a built model: each attention's indexer becomes a TrainableIndexer (its
    parameters unchanged) that requires gradients; in warmup every other parameter is frozen. Before the engine (its
    optimizer takes the parameters that require gradients). Returns the number of indexers."""
    indexers = []
    for attn in model.modules():
        if isinstance(attn, v32.DeepseekV32Attention):
            indexer = attn.indexer
            indexer.__class__ = TrainableIndexer  # no new parameters: a subclass adding a forward
            indexer.stage = stage
            indexer.main_attention = weakref.ref(attn)  # not a submodule: its parameters are the attention's own
            indexers.append(indexer)
    if stage == "warmup":
        model.requires_grad_(False)
    for indexer in indexers:
        indexer.requires_grad_(True)
    return len(indexers)
