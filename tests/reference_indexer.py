"""The independent reference of DeepSeek-V3.2's indexer loss (V3.2 report sec. 2.1.1; issue 48's definition), written
from the definition apart from deepseek_ds.models.deepseek_v32: transformers' model in eager attention returns each
layer's attention probabilities (output_attentions), its indexers' inputs and selections are read with hooks, and the
index scores are the whole [B, S, H_I, T] tensor at once.

For each layer and each query t with a target: p_t = the attention's probabilities summed over heads, L1-normalised;
q_t = softmax of the index scores over the same keys (the causal ones, or those the indexer selected among them);
KL_t = sum_s p_t(s) (log p_t(s) - log q_t(s)). The loss is the mean of KL_t over layers and counted queries."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32


def whole_index_scores(indexer, hidden, q_resid, position_embeddings) -> torch.Tensor:
    """[B, S, T] = sum_h w[b,s,h] H^-1/2 relu(D^-1/2 q[b,s,h] . k[b,t]), every head and key at once."""
    b, s, _ = hidden.shape
    rope, d, h = indexer.qk_rope_head_dim, indexer.head_dim, indexer.n_heads
    q = indexer.wq_b(q_resid).view(b, s, h, d)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = v32.apply_rotary_pos_emb(q[..., :rope], k[..., :rope], *position_embeddings, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], -1).double()
    k = torch.cat([k_rot, k[..., rope:]], -1).squeeze(2).double()
    relu = torch.einsum("bshd,btd->bsht", q, k).mul(d ** -0.5).clamp(min=0)
    w = indexer.weights_proj(hidden).double() * h ** -0.5
    return torch.einsum("bsh,bsht->bst", w, relu)


def indexer_loss_reference(model, input_ids: torch.Tensor, labels: torch.Tensor,
                           sparse: bool) -> tuple[float, torch.Tensor]:
    """(transformers' LM loss, the indexer loss, float64 with a gradient to the indexers' parameters) of `model`
    (DeepseekV32ForCausalLM, eager attention) on one batch. sparse: the keys are those the indexer selected;
    otherwise (a dense model, every key selected) the causal ones."""
    seen = []

    def keep(module, args, kwargs, out):
        hidden, q_resid, position_embeddings, mask = args[:4]
        seen.append((module, hidden, q_resid, position_embeddings, mask, out))

    hooks = [m.register_forward_hook(keep, with_kwargs=True) for m in model.modules()
             if isinstance(m, v32.DeepseekV32Indexer)]
    with torch.no_grad():
        out = model(input_ids=input_ids, output_attentions=True)
    for hook in hooks:
        hook.remove()
    lm = model.loss_function(logits=out.logits, labels=None, shift_labels=labels,
                             vocab_size=model.config.vocab_size).item()
    counted = labels != -100
    total = 0.0
    for (indexer, hidden, q_resid, pe, mask, selected), probs in zip(seen, out.attentions):
        causal = mask if mask.dtype == torch.bool else mask == 0
        keys = causal
        if sparse:
            keys = causal & torch.zeros_like(causal).scatter_(-1, selected.long(), True)
        p = probs.double().sum(1)
        p = p / p.sum(-1, keepdim=True)
        log_q = torch.log_softmax(whole_index_scores(indexer, hidden, q_resid, pe).masked_fill(~keys, -torch.inf), -1)
        kl = torch.where(keys, torch.xlogy(p, p) - p * log_q.masked_fill(~keys, 0), 0.0).sum(-1)
        total = total + kl[counted].sum()
    return lm, total / (len(seen) * counted.sum())
