"""Tiled MLPs for long sequences (DeepSpeed's ALST, arXiv:2506.13996): every decoder layer's MLP computes its
micro-batch's B x T tokens (flattened, in order: along each sequence) in tiles of `tokens_per_tile`. Forward runs
the tiles without autograd and keeps only the MLP's input; backward recomputes each tile's forward and
back-propagates it at once. So the [tokens, intermediate] activations of the dense MLP, the routed experts and the
shared experts exist for one tile at a time, in forward and in backward, at the cost of one more MLP forward.

Dense MLPs use DeepSpeed's TiledMLP. An MoE block keeps its router, and so its hooks (moe.py), on the whole
sequence: the router runs once per forward, as untiled, and its expert loads, routing and balance losses see every
token exactly once and in whole sequences; only the experts' and shared experts' computation is tiled.

The modules stay transformers' own (only their `forward` is replaced on the instance): parameter names and
state_dict keys do not change, and peft's adapters, ZeRO-3's module hooks and activation checkpointing see the
same modules. Under ZeRO-3 every tile calls the expert modules, whose hooks gather their parameters, in forward
and again in backward's recomputation; every rank of a data-parallel group must run the same number of tiles
(micro-batches have a fixed shape here: micro_batch_size x seq_len).
"""

from __future__ import annotations

import math
from functools import partial

import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
from torch import nn
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from .layers import DecoderLayerPipe
from .moe import HF_ROUTERS, moe_blocks

DENSE_MLPS = (DeepseekV3MLP, DeepseekV2MLP, LlamaMLP, Qwen2MLP)


def tiled_mlp_errors(tokens_per_tile: int, expert_parallel: int) -> list[str]:
    """The run config's train.tiled_mlp against the layout, one line each (config.validate)."""
    if tokens_per_tile and expert_parallel > 1:
        return [f"train.tiled_mlp ({tokens_per_tile}) with parallel.expert_parallel ({expert_parallel}): AutoEP's MoE "
                "blocks (DeepSpeed's router, all-to-all and grouped GEMM in one forward) cannot be tiled; set "
                "train.tiled_mlp: 0 or parallel.expert_parallel: 1"]
    return []


def tile_mlps(model: nn.Module, tokens_per_tile: int) -> int:
    """Make every decoder layer's MLP (MTP modules' included) compute in tiles of `tokens_per_tile` tokens; returns
    the number of MLPs tiled. Apply before or after LoRA's injection, before or after deepspeed.initialize, but
    not to AutoEP's MoE blocks (expert parallelism), which are refused."""
    if tokens_per_tile < 1:
        raise ValueError(f"tokens_per_tile must be >= 1, not {tokens_per_tile}")
    autoep = [name for name, (_, router) in moe_blocks(model).items() if not isinstance(router, HF_ROUTERS)]
    if autoep:
        # AutoEP's block is DeepSpeed's own module (its router, all-to-all token dispatch and grouped GEMM in one
        # forward): tiling it would mean rewriting that forward, with its all-to-alls rerun per tile in backward.
        raise ValueError(f"tiled MLPs do not support AutoEP's MoE blocks ({autoep[0]}, ...): train with "
                         "parallel.expert_parallel=1")
    count = 0
    for layer in model.modules():
        if not isinstance(layer, DecoderLayerPipe):
            continue
        mlp = layer.layer.mlp
        if isinstance(mlp, DENSE_MLPS):
            mlp.forward = partial(_dense_forward, mlp, tokens_per_tile)
        elif isinstance(getattr(mlp, "gate", None), HF_ROUTERS):
            mlp.forward = partial(_moe_forward, mlp, tokens_per_tile)
        else:
            raise ValueError(f"tiled MLPs: no tiling for {type(mlp).__name__} (layer {layer.layer_idx})")
        count += 1
    return count


def _trainable(*modules: nn.Module) -> list[nn.Parameter]:
    # Read at each forward: adapters peft injected after tile_mlps are parameters of these modules too.
    return [p for m in modules for p in m.parameters() if p.requires_grad]


def _graph_input(x: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    # An autograd.Function's output requires grad only if one of its inputs does: where everything before the MLP
    # is frozen but its own parameters train (LoRA on the routed experts), x must, or backward never reaches them.
    return x.detach().requires_grad_() if params and not x.requires_grad else x


def _dense_call(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(mlp).forward(mlp, x)


def _dense_forward(mlp: nn.Module, tile: int, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= tile:
        return _dense_call(mlp, x)
    params = _trainable(mlp)
    # ceil(N / tile) chunks: torch.chunk then makes exactly that many (none larger than tile), so TiledMLP's last
    # chunk, the one that hands ZeRO the gradients (ds_grad_is_ready), is its last shard.
    shards = math.ceil(flat.shape[0] / tile)
    return TiledMLP.apply(_dense_call, mlp, _graph_input(flat, params), shards, params).view(x.shape)


def _moe_forward(block: nn.Module, tile: int, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3MoE / DeepseekV2Moe forward, with the routed and shared experts tiled."""
    if hidden_states.numel() // hidden_states.shape[-1] <= tile:
        return type(block).forward(block, hidden_states)
    _, weights, indices = block.gate(hidden_states)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    params = _trainable(block.experts, block.shared_experts)
    out = _TiledExperts.apply(block, tile, params, _graph_input(x, params), weights, indices)
    return out.view(hidden_states.shape)


def _experts(block: nn.Module, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return block.experts(x, indices, weights) + block.shared_experts(x)


class _TiledExperts(torch.autograd.Function):
    """The routed + shared experts of tokens x (N, H) routed to `indices` with `weights` (N, top-k), a tile at a
    time. DeepSpeed's TiledMLP / SequenceTiledCompute do not serve the MoE block: around the whole block they would
    run the router per tile, without autograd in forward (its logits would carry no balance-loss gradient) and
    again in backward, and its hooks would see tiles, where the balance loss needs each whole sequence's routing;
    around the experts alone they return a gradient for one input only, and the routing weights need theirs too
    (the router's gradient flows through them). So the router runs outside, on the whole sequence."""

    @staticmethod
    def forward(ctx, block, tile, params, x, weights, indices):
        ctx.block, ctx.tile, ctx.params = block, tile, params
        ctx.save_for_backward(x, weights, indices)
        out = torch.empty_like(x)
        for s in _tiles(x.shape[0], tile):
            out[s] = _experts(block, x[s], weights[s], indices[s])
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weights, indices = ctx.saved_tensors
        inputs = (x, weights)
        grads = [torch.zeros_like(t) if need else None for t, need in zip(inputs, ctx.needs_input_grad[3:5])]
        tiles = _tiles(x.shape[0], ctx.tile)
        for i, s in enumerate(tiles):
            # ZeRO takes a parameter's gradient when its hook fires: only after the last tile's share is summed
            # (DeepSpeed's flag, as TiledMLP sets it). Each tile uses every parameter (the routed experts' are
            # fused 3-D tensors), so the last tile's backward fires every hook.
            for p in ctx.params:
                p.ds_grad_is_ready = i == len(tiles) - 1
            xt, wt = (t[s].detach().requires_grad_(g is not None) for t, g in zip(inputs, grads))
            for t, g in zip((xt, wt), grads):
                if g is not None:
                    t.grad = g[s]  # backward accumulates into the whole tensor's gradient in place
            with torch.enable_grad():
                out = _experts(ctx.block, xt, wt, indices[s])
            torch.autograd.backward(out, grad[s])
        return None, None, None, *grads, None


def _tiles(n: int, tile: int) -> list[slice]:
    return [slice(a, min(a + tile, n)) for a in range(0, n, tile)]
