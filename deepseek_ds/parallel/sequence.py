"""Sequence parallelism (DeepSpeed-Ulysses) for DeepSeek's MLA and Llama attention.

Each sample's sequence is split into `size` contiguous shards, one per rank of a sequence group. Everything but
attention works on a rank's own tokens (norms, MLPs, experts, the loss); inside attention an all-to-all turns the
sequence shards of q, k and v into head shards (every rank attends over the whole sequence for heads/size heads) and
another turns the output back. Rotary embeddings take the global positions (each shard's position ids are its slice
of the sequence's); document masks are built over the whole sequence from the gathered position ids.

Written here rather than taken from DeepSpeed's `UlyssesSPAttentionHF` / `DistributedAttention`: they take one head
size from `config.head_dim` (for DeepSeek configs the rope dim) and assert key.shape == value.shape, while MLA's
query/key heads are qk_nope + qk_rope wide and its value heads v_head_dim. Their all-to-all
(private_api.sequence_all_to_all), which reads each tensor's own head size, is used as it is.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..models.layers import DecoderLayerPipe, EmbeddingPipe, MTPLayerPipe
from ..models.loss import IGNORE_INDEX
from ..utils.private_api import attention_implementation, sequence_all_to_all, set_attention_implementation

# transformers' attention registry name of the sequence-parallel attention (set on each attention module's own config).
ULYSSES = "deepseek_ds_ulysses"
# What runs on the gathered sequence: implementations that take the whole sequence and a mask (or varlen bounds).
INNER_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


@dataclass(frozen=True)
class SequenceShard:
    """One rank's place in its sequence group: shard `rank` of `size` of every sequence."""
    group: ProcessGroup
    rank: int
    size: int

    def take(self, t: torch.Tensor, halo: int = 0, fill: int = 0) -> torch.Tensor:
        """This rank's contiguous slice of dim 1 (the sequence) of a [batch, seq, ...] tensor, and the next `halo`
        elements after it (`fill` past the sequence's end)."""
        n = t.shape[1] // self.size
        piece = t[:, self.rank * n:(self.rank + 1) * n + halo]
        short = n + halo - piece.shape[1]
        return torch.cat([piece, piece.new_full((piece.shape[0], short, *piece.shape[2:]), fill)], 1) if short else piece

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The whole sequence of a [batch, shard] tensor that needs no gradient (position ids)."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


def shard_micro_batch(micro_batch: tuple, shard: SequenceShard | None, halo: int = 0) -> tuple:
    """(input_ids, labels[, position_ids]) cut to this rank's shard of each sequence. Labels are already the next
    tokens (shifted before the split), so no target is lost at a shard boundary; a micro-batch without position ids
    gets them from the embedding (the shard's global positions). halo: also the next shard's first `halo` tokens,
    labels and positions (MTP depth d reads token i + d and its target; ignored labels past the sequence's end)."""
    if shard is None:
        return micro_batch
    fills = (0, IGNORE_INDEX, 0)
    return tuple(shard.take(t, halo, fill) for t, fill in zip(micro_batch, fills))


def sequence_parallel_errors(sp: int, *, heads: int, kv_heads: int, seq_len: int, attn_implementation: str,
                             pipeline_stages: int, tensor_parallel: int, mtp_depth: int, objective: str,
                             compile: bool) -> list[str]:
    """What a sequence-parallel layout of `sp` ranks cannot do, one line each naming the field and the fix."""
    if sp == 1:
        return []
    errors = []
    if heads % sp or kv_heads % sp:
        errors.append(f"parallel.sequence_parallel ({sp}) must divide the attention heads (num_attention_heads "
                      f"{heads}, num_key_value_heads {kv_heads}): each rank attends over heads / sp whole heads")
    if seq_len % sp:
        errors.append(f"data.seq_len ({seq_len}) must be divisible by parallel.sequence_parallel ({sp}): every rank "
                      f"holds seq_len / sp tokens of each sequence; use a multiple of {sp}")
    if attn_implementation not in INNER_IMPLEMENTATIONS:
        errors.append(f"model.attn_implementation {attn_implementation!r} cannot serve parallel.sequence_parallel "
                      f"({sp}): attention runs on the gathered sequence, which {', '.join(INNER_IMPLEMENTATIONS)} "
                      "can; set model.attn_implementation: sdpa")
    if pipeline_stages > 1:
        errors.append(f"parallel.sequence_parallel ({sp}) with parallel.pipeline_stages ({pipeline_stages}): "
                      "DeepSpeed's pipeline grid has no sequence axis to build the groups on; set one of them to 1")
    if tensor_parallel > 1:
        errors.append(f"parallel.sequence_parallel ({sp}) with parallel.tensor_parallel ({tensor_parallel}): "
                      "DeepSpeed 0.19.8's AutoTP builds its data x tensor mesh over the whole world, with no sequence "
                      "axis; set one of them to 1")
    if mtp_depth and seq_len // sp <= mtp_depth:
        errors.append(f"parallel.sequence_parallel ({sp}) with {mtp_depth} MTP module(s): each shard of data.seq_len "
                      f"({seq_len}) must be longer than the MTP depth (depth k reads token i+k from the next shard); "
                      "use a longer data.seq_len or a smaller parallel.sequence_parallel")
    if objective != "lm":
        errors.append(f"parallel.sequence_parallel ({sp}) with train.objective {objective!r}: the preference loss "
                      "needs each sequence's whole log-probability on one rank; use train.objective: lm or "
                      "parallel.sequence_parallel: 1")
    if compile:
        errors.append(f"parallel.sequence_parallel ({sp}) with train.compile: the all-to-all inside attention would "
                      "break each compiled layer's graph; set train.compile: false")
    return errors


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs):
    """transformers' attention interface over a sequence shard: q/k/v [batch, heads, shard, dim] (each with its own
    dim: MLA's values are narrower than its queries and keys) -> all-to-all -> [batch, heads/sp, seq, dim] -> the
    module's inner implementation with the whole sequence's mask -> all-to-all -> [batch, shard, heads, v dim]."""
    shard: SequenceShard = module.sequence_shard

    def to_heads(t):  # [b, h, s/sp, d] -> [b, h/sp, s, d]
        return sequence_all_to_all(shard.group, t.transpose(1, 2), 2, 1, 0).transpose(1, 2)

    inner = _inner_function(module)
    out, weights = inner(module, to_heads(query), to_heads(key), to_heads(value), attention_mask, **kwargs)
    # out: [b, s, h/sp, dv] (every implementation returns it sequence-first) -> [b, s/sp, h, dv]
    return sequence_all_to_all(shard.group, out, 1, 2, 0), weights


def _inner_function(module: nn.Module):
    if module.inner_attention == "eager":  # each transformers family has its own eager function
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[module.inner_attention]


def _mtp_valid_tokens(layer: MTPLayerPipe, mlp: nn.Module, args):
    """Forward pre-hook on an MTP module's MLP: on the last shard only the positions that have a token i + depth
    (layer.mlp_tokens) reach it, so the expert loads and balance losses see the tokens they see without SP."""
    if layer.mlp_tokens is None:
        return None
    layer.mlp_positions = args[0].shape[1]
    return (args[0][:, :layer.mlp_tokens].contiguous(), *args[1:])


def _mtp_pad_back(layer: MTPLayerPipe, mlp: nn.Module, args, output):
    """Forward hook: the left-out positions get a zero MLP output (their hidden state is the residual; no target)."""
    if layer.mlp_tokens is None:
        return None
    return nn.functional.pad(output, (0, 0, 0, layer.mlp_positions - layer.mlp_tokens))


def keep_mtp_to_real_tokens(model: nn.Module) -> int:
    """The MTP modules' MLP hooks above, on the engine's module (after AutoEP has replaced the MoE blocks, before
    the load balancer's hooks, which then see the real tokens); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, MTPLayerPipe) and m.sequence_shard is not None]
    for layer in layers:
        layer.layer.mlp.register_forward_pre_hook(partial(_mtp_valid_tokens, layer))
        layer.layer.mlp.register_forward_hook(partial(_mtp_pad_back, layer))
    return len(layers)


def _attention_modules(model: nn.Module):
    for layer in model.modules():
        if isinstance(layer, DecoderLayerPipe):
            yield layer, layer.layer.self_attn


def enable(model: nn.Module, shard: SequenceShard) -> int:
    """Make every decoder layer of `model` attend through the sequence group; returns how many. The embedding then
    gives each shard its global positions, and document masks span the gathered sequence."""
    AttentionInterface.register(ULYSSES, ulysses_attention)  # idempotent: the same function under the same name
    count = 0
    for layer, attn in _attention_modules(model):
        layer.sequence_shard = shard
        attn.sequence_shard = shard
        attn.inner_attention = attention_implementation(attn.config)
        attn.config = copy.copy(attn.config)  # this module's alone: the layer's config keeps the inner one (masks)
        set_attention_implementation(attn.config, ULYSSES)
        count += 1
    for m in model.modules():
        if isinstance(m, EmbeddingPipe):
            m.sequence_shard = shard
    return count


@contextlib.contextmanager
def whole_sequences(model: nn.Module):
    """Every rank's attention runs whole sequences on its own for the duration: generation through transformers'
    model (to_hf_model), each rank its own prompts."""
    changed = [attn for _, attn in _attention_modules(model) if getattr(attn, "sequence_shard", None)]
    for attn in changed:
        set_attention_implementation(attn.config, attn.inner_attention)
    try:
        yield
    finally:
        for attn in changed:
            set_attention_implementation(attn.config, ULYSSES)
