"""Pipeline-stage layers built from transformers' own DeepSeek / Llama / Qwen2 modules.

Only `(hidden_states, position_ids)` travels between stages (plus `input_ids` when the model has multi-token
prediction modules, which embed future tokens on the last stage, or hash-routed layers: DeepSeek-V4, whose hidden
states are its hyper-connection streams); every decoder layer rebuilds its rotary embedding locally (it has no
parameters), and each stage its document mask (see `document_attention`; a family's own through its layer_kwargs).
The HF names of each layer's tensors are in names.py, which is what lets a stage read and write exactly its own
tensors of an HF directory.
"""

from __future__ import annotations

import deepspeed
import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from ..utils.private_api import attention_implementation
from .family import cached_on
from .loss import Projection
from .registry import family_of


def mtp_depth(config) -> int:
    """Number of multi-token-prediction modules (DeepSeek-V3's `num_nextn_predict_layers`; 0 for other models)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0) if family_of(config).has_mtp else 0


def init_weights_(module: nn.Module, std: float, seed: int) -> None:
    """Initialise one layer from its own seed, so that the initial model does not depend on how layers are split
    into stages or which rank builds them. Written by hand because transformers initialises a whole model from
    the global RNG; the distribution is the same as its `_init_weights` (normal(0, std), norms 1, biases 0)."""
    gen = torch.Generator().manual_seed(seed)
    # Under deepspeed.zero.Init (ZeRO-3) each parameter is partitioned as soon as its own module is built: initialise
    # the whole tensor, then rank 0's values are partitioned again (every rank draws the same). A no-op otherwise.
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
        _init_parameters(module, std, gen)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias") and b.device.type != "meta":
            b.zero_()


def _initialise(module: nn.Module, config, seed: int | None) -> None:
    """The shared initialisation from the layer's seed (None: weights to be loaded), then the family's own."""
    if seed is not None:
        init_weights_(module, config.initializer_range, seed)
    prepare = family_of(config).prepare_layer
    if prepare is not None:
        prepare(module, seed)


def _init_parameters(module: nn.Module, std: float, gen: torch.Generator) -> None:
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        with torch.no_grad():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":  # a LayerNorm's too (DeepSeek-V3.2's indexer)
                p.zero_()
            elif "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))


class EmbeddingPipe(nn.Module):
    def __init__(self, config, seed: int | None = None):
        super().__init__()
        fam = family_of(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        self.mtp_depth = mtp_depth(config)
        # The MTP modules on the last stage embed the input tokens again; hash-routed layers route by them.
        self.carry_ids = self.mtp_depth > 0 or fam.carries_token_ids
        # Hyper-connections (DeepSeek-V4): each token enters the layers as hc_mult copies of its embedding.
        self.streams = config.hc_mult if fam.streams_head else 0
        self.defer_logits = False  # as a tied head in training: a Projection for the chunked loss (defer_logits)
        self.sequence_shard = None  # sequence parallelism: inputs are this shard of each sequence (parallel.sequence)
        if seed is not None:
            init_weights_(self, config.initializer_range, seed)

    def forward(self, inputs):
        """inputs: input_ids, or (input_ids, position_ids) for packed sequences (positions restart at 0 at each
        document), or (input_ids, position_ids, query_mask) (models.pipeline.split_micro_batch); without position
        ids every sequence is one document. A sequence shard with MTP depths D trains on
        its tokens and the next D (parallel.sequence.shard_micro_batch's halo): the MTP modules read them."""
        input_ids, position_ids, *query_mask = inputs if isinstance(inputs, tuple) else (inputs, None)
        carried = input_ids
        if self.sequence_shard is not None and self.training and self.mtp_depth:
            input_ids = input_ids[:, :-self.mtp_depth]
            position_ids = None if position_ids is None else position_ids[:, :-self.mtp_depth]
        hidden = self.embed_tokens(input_ids)
        if self.streams:
            hidden = hidden.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()
        one_document = position_ids is None
        if one_document:
            # A sequence shard's positions are its place in the whole sequence.
            start = self.sequence_shard.rank * input_ids.shape[1] if self.sequence_shard else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0) \
                .expand_as(input_ids)
        position_ids = position_ids.contiguous()
        # Known here without reading the tensor: document_attention then skips transformers' packed-sequence check,
        # a host-device sync per micro-batch. The mark stays on this stage (a later one receives a new tensor).
        position_ids._one_document = one_document
        # A trainable DeepSeek-V3.2 indexer's query mask (split_micro_batch) goes on to every layer, last.
        return (hidden, position_ids, *([carried] if self.carry_ids else []), *query_mask)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head: logits from the embedding matrix."""
        return nn.functional.linear(hidden, self.embed_tokens.weight)


class DecoderLayerPipe(nn.Module):
    def __init__(self, config, layer_idx: int, seed: int | None = None):
        super().__init__()
        fam = family_of(config)
        self.layer_idx = layer_idx
        self.config = config
        self.layer = fam.decoder_layer(config, layer_idx)
        self.rotary = fam.rotary(config)
        self.layer_kwargs = fam.layer_kwargs
        self.carries_token_ids = fam.carries_token_ids  # hash-routed layers read them (DeepSeek-V4)
        self.sequence_shard = None  # sequence parallelism: attention spans the group's shards (parallel.sequence)
        _initialise(self, config, seed)

    def run_layer(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                  input_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.layer_kwargs is not None:  # the family's own (DeepSeek-V4, V3.2)
            return self.layer(hidden, **self.layer_kwargs(self.config, self.rotary, hidden, position_ids, input_ids))
        position_embeddings = self.rotary(hidden, position_ids)
        return self.layer(hidden, position_ids=position_ids, position_embeddings=position_embeddings,
                          **document_attention(self.config, hidden, position_ids, self.sequence_shard))

    def forward(self, inputs):
        hidden, position_ids, *carried = inputs  # token ids (MTP, hash routing), a query mask: passed on
        ids = carried[:1] if self.carries_token_ids else ()
        return self.run_layer(hidden, position_ids, *ids), position_ids, *carried


def document_attention(config, hidden: torch.Tensor, position_ids: torch.Tensor, shard=None) -> dict:
    """The attention keyword arguments for causal attention within each document of a sequence (a document starts
    wherever position_ids is 0). Sequences without a restart get attention_mask=None: SDPA/flash take their
    mask-free causal path, exactly as before packing existed. Otherwise: flash_attention_2 gets the varlen
    boundaries (the batch flattened, one segment per document); the other implementations get transformers' own
    block-diagonal causal mask from the position ids, in the layout each expects (SDPA boolean, eager additive).
    With a sequence shard (parallel.sequence.SequenceShard) attention runs over the whole sequence: the mask is the
    whole sequence's, from the group's gathered position ids."""
    # Every layer of a stage gets the same position_ids tensor in one forward: the first builds the mask and keeps it
    # on that tensor, so it is built once per stage and micro-batch and freed with it.
    attn = attention_implementation(config)
    return cached_on(position_ids, (attn, hidden.dtype),
                     lambda: _document_attention(config, attn, hidden, position_ids, shard))


def _document_attention(config, attn: str, hidden: torch.Tensor, position_ids: torch.Tensor, shard) -> dict:
    one_document = getattr(position_ids, "_one_document", False)
    if shard is not None:
        # Only the mask's shape, dtype and device are read from it: an empty tensor of the whole sequence's length.
        hidden = hidden.new_empty((hidden.shape[0], hidden.shape[1] * shard.size, 0))
        position_ids = position_ids if one_document else shard.gather(position_ids)
    if attn.startswith("flash_attention"):
        return {"attention_mask": None} if one_document else _varlen_kwargs(position_ids)
    # Without position ids transformers builds the plain causal mask (None for SDPA) without looking for packed
    # sequences in them, which reads them to the host.
    return {"attention_mask": create_causal_mask(config, hidden, None, None,
                                                 position_ids=None if one_document else position_ids)}


def _varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """flash-attention's varlen arguments: cumulative document lengths over the flattened batch (each row starts
    a document too), which transformers' flash path takes as cu_seq_lens_* / max_length_*."""
    starts = position_ids == 0
    if not starts[:, 1:].any():
        return {"attention_mask": None}
    starts[:, 0] = True
    flat = starts.reshape(-1).nonzero().view(-1)
    cu = torch.cat([flat, flat.new_tensor([starts.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"attention_mask": None, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}


class FinalNormPipe(nn.Module):
    def __init__(self, config, seed: int | None = None):
        super().__init__()
        fam = family_of(config)
        self.norm = fam.norm(config.hidden_size, eps=config.rms_norm_eps)
        # Hyper-connections (DeepSeek-V4): the head collapsing the streams into one hidden state, before the norm.
        self.hc_head = fam.streams_head(config) if fam.streams_head else None
        self.mtp = mtp_depth(config) > 0
        _initialise(self, config, seed)

    def forward(self, inputs):
        hidden, *rest = inputs
        if self.hc_head is not None:
            hidden = self.hc_head(hidden)
        # With MTP modules the positions and input ids go on to them (in training; see mtp_embed_forward).
        return (self.norm(hidden), *rest) if self.mtp else self.norm(hidden)


class LMHeadPipe(nn.Module):
    def __init__(self, config, seed: int | None = None):
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.defer_logits = False  # in training: a Projection for the chunked loss (pipeline.defer_logits)
        if seed is not None:
            init_weights_(self, config.initializer_range, seed)

    def forward(self, hidden):
        # An adapter wrapping the head (peft) changes what it computes: then its weight alone is not the head.
        if self.training and self.defer_logits and type(self.lm_head) is nn.Linear:
            return _projection(hidden, self.lm_head.weight)
        return _logits(self.lm_head, hidden)


# ----------------------------------------------------------------------------------------------- multi-token prediction
class MTPLayerPipe(DecoderLayerPipe):
    """DeepSeek-V3's multi-token-prediction module k (tech report sec. 2.2), training-only: it predicts token i+k+1
    at position i from the previous depth's representation and the embedding of token i+k:
        h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]),  h^k = shared_head.norm(TRM_k(h')),
    with h^0 the main model's final (normed) hidden state and the embedding and output head shared with the main
    model. The order of the concatenation and the norm that feeds the next depth follow transformers' MtpLayer,
    so an export loads there; the names are the published checkpoint's `model.layers.{num_hidden_layers + k - 1}.*`.

    In the pipeline it sits on the last stage after `mtp_embed_forward`, and passes on a flat tuple
    (position_ids, token embeddings, h^k, main output, outputs of depths 1..k); the last depth hands the head the
    tuple of outputs, depth k's covering the first T - k positions. In evaluation it is skipped: the main model
    alone is the language model.
    """

    def __init__(self, config, layer_idx: int, seed: int | None = None):
        super().__init__(config, layer_idx, seed=None)
        norm = family_of(config).norm
        self.depth = layer_idx - config.num_hidden_layers + 1
        self.last = self.depth == mtp_depth(config)
        self.enorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp_tokens = None  # sequence parallelism, last shard: the positions that have a token i + depth
        if seed is not None:
            init_weights_(self, config.initializer_range, seed)

    def forward(self, inputs):
        if not isinstance(inputs, tuple):
            return inputs  # evaluation: mtp_embed_forward passed on the main output alone
        position_ids, embeds, previous, *outputs = inputs
        # Position i reads token i + depth: only the first T - depth positions have one (and a target), so depth k
        # runs on T - k positions. No padding: the balance losses and expert loads then see real tokens only.
        # A sequence shard runs on all its positions (the all-to-alls need equal shards) and reads the next shard's
        # first tokens from its halo (embeds: shard + D tokens); on the last shard the final k positions have no
        # token i + k: its MLP leaves them out (mlp_tokens, parallel.sequence), so the same real tokens count.
        length = min(previous.shape[1], embeds.shape[1] - self.depth)
        if self.sequence_shard is not None and self.sequence_shard.rank == self.sequence_shard.size - 1:
            self.mlp_tokens = length - self.depth
        hidden = self.eh_proj(torch.cat([self.enorm(embeds[:, self.depth:self.depth + length]),
                                         self.hnorm(previous[:, :length])], dim=-1))
        positions = position_ids[:, :length]
        positions._one_document = getattr(position_ids, "_one_document", False)  # a new tensor: see EmbeddingPipe
        hidden = self.shared_head.norm(self.run_layer(hidden, positions))
        outputs.append(hidden)
        return tuple(outputs) if self.last else (position_ids, embeds, hidden, *outputs)


def mtp_embed_forward(embedding: EmbeddingPipe, inputs):
    """The tied embedding's use on the last stage: embeds the input tokens once for every MTP depth."""
    normed, position_ids, input_ids = inputs
    if not embedding.training:
        return normed
    return position_ids, embedding.embed_tokens(input_ids), normed, normed


def _logits(project, hidden):
    """Logits of the main output, or the tuple of logits of (main, MTP depth 1..D) in MTP training."""
    if isinstance(hidden, tuple):
        return tuple(project(h) for h in hidden)
    return project(hidden)


def _projection(hidden, weight: torch.Tensor) -> Projection:
    return Projection(hidden if isinstance(hidden, tuple) else (hidden,), weight)


def tied_head_forward(embedding: EmbeddingPipe, hidden):
    if embedding.training and embedding.defer_logits and type(embedding.embed_tokens) is nn.Embedding:
        return _projection(hidden, embedding.embed_tokens.weight)
    return _logits(embedding.project, hidden)
