"""The indexer loss of a run with trainable DeepSeek-V3.2 indexers (indexer.py), as the training loop sees it:
    indexer_loss = the mean over the DSA layers and the global batch's counted query tokens (those with a target,
                   labels != -100) of KL_t,
    loss = lm_loss + indexer.loss_weight x indexer_loss.
Each layer's KL sum reaches the backward as the MoE balance losses do (aux_grad.AuxLossGrad on the attention's output),
with the gradient weight x gradient ranks / (counted queries x layers): DeepSpeed averages gradients over the
data-parallel ranks, and gradient accumulation divides only the LM loss."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

from ...utils.private_api import in_backward
from ..aux_grad import AuxLossGrad
from .indexer import TrainableIndexer


class IndexerLoss:
    """Hooks on this rank's decoder layers holding a TrainableIndexer: before each layer, the micro-batch's query mask
    (the third element the pipeline carries, models/layers.py) goes to its indexer; after its attention, the
    indexer's KL sum joins the backward and, outside activation checkpointing's re-runs, the step's sum."""

    def __init__(self, model: nn.Module, loss_weight: float, num_layers: int, device,
                 loss_scale: Callable[[], float] | None = None):
        self.loss_weight, self.num_layers, self.loss_scale = loss_weight, num_layers, loss_scale
        self.per_query: torch.Tensor | None = None  # 1 / (counted queries x layers), set per global batch
        self.gradient_ranks = 1
        self.sums = torch.zeros(1, dtype=torch.float64, device=device)
        for layer in model.modules():
            attn = getattr(getattr(layer, "layer", None), "self_attn", None)
            if isinstance(attn, v32.DeepseekV32Attention) and isinstance(attn.indexer, TrainableIndexer):
                layer.register_forward_pre_hook(partial(_hand_query_mask, attn.indexer))
                attn.register_forward_hook(self._on_attention)

    def set_global_tokens(self, counted_queries: torch.Tensor, gradient_ranks: int) -> None:
        """counted_queries: the global batch's tokens with a target (the LM loss's count; a device tensor, not read)."""
        self.per_query = 1.0 / (counted_queries.double().clamp(min=1) * self.num_layers)
        self.gradient_ranks = gradient_ranks

    def _on_attention(self, attn: nn.Module, args, output):
        kl, attn.indexer.kl_sum = attn.indexer.kl_sum, None
        if kl is None:
            return None
        if self.per_query is None:
            raise RuntimeError("IndexerLoss.set_global_tokens must be called before each global batch")
        if not in_backward():  # activation checkpointing's re-run forward counts once
            self.sums += kl.detach().double() * self.per_query
        if not kl.requires_grad:
            return None
        scale = (self.loss_weight * self.gradient_ranks * self.per_query).float()
        if self.loss_scale is not None:  # fp16 scales the LM loss's gradients: the indexer loss's must follow
            scale = scale * self.loss_scale()
        return (AuxLossGrad.apply(output[0], kl, scale), *output[1:])

    def take(self) -> torch.Tensor:
        """This rank's share of the step's indexer_loss (summed over every rank it is the global mean), then 0."""
        total = self.sums.clone()
        self.sums.zero_()
        return total

    def metrics(self, summed: float, lm_loss: float) -> dict[str, float]:
        return {"lm_loss": lm_loss, "indexer_loss": summed, "loss": lm_loss + self.loss_weight * summed}


def _hand_query_mask(indexer: TrainableIndexer, layer: nn.Module, args) -> None:
    inputs = args[0]
    indexer.query_mask = inputs[2] if isinstance(inputs, tuple) and len(inputs) > 2 else None
