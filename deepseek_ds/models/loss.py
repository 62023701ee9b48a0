"""Causal LM loss, token-weighted over the whole global batch.

DeepSpeed divides each micro-batch loss by the gradient-accumulation steps and averages gradients over
data-parallel ranks. Scaling each micro-batch's summed token loss by dp * gas / (valid tokens in the global
batch) turns that into exactly the mean over every valid token of the global batch, which is what
transformers computes for the same batch in one piece, even when micro-batches hold different numbers of
valid (non -100) tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class TokenWeightedLoss:
    __name__ = "TokenWeightedLoss"

    def __init__(self):
        self.scale = None  # set per global batch by the training loop (set_global_tokens)

    def set_global_tokens(self, global_valid_tokens: int, dp_size: int, grad_accum: int) -> None:
        self.scale = dp_size * grad_accum / max(int(global_valid_tokens), 1)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("TokenWeightedLoss.set_global_tokens must be called before each global batch")
        summed = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
        return summed * self.scale


def count_valid_tokens(micro_batches) -> int:
    return sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
