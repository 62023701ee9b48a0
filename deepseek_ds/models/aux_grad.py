"""A loss added beside the LM loss without joining it: the MoE balance losses (moe.py) and DeepSeek-V3.2's indexer
loss (deepseek_v32/indexer_loss.py) reach the backward through the output of the module that computed them."""

from __future__ import annotations

import torch


class AuxLossGrad(torch.autograd.Function):
    """Returns `output` unchanged; in backward it also gives `aux` the gradient `scale`, as if `scale * aux` had
    been added to the loss (Megatron-LM's MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.scale = scale  # a float, or a 0-d tensor on aux's device (no host read)
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_like
        if isinstance(ctx.scale, torch.Tensor):
            return grad, ctx.scale.to(dtype).expand(shape).clone(), None
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None  # no host-to-device copy
