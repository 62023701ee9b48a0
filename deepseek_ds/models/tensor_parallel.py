"""Tensor parallelism with DeepSpeed AutoTP: which matrices are split (the partition config DeepSpeed applies), the
one gradient MLA needs summed that AutoTP does not sum, per-rank shard sizes, and the rules a TP layout must meet.

Why an explicit partition config rather than DeepSpeed's own choice: with no partition config, AutoTP (0.19.8)
takes the model's HF `tp_plan` or, failing that, its name heuristics, and our model is no transformers
PreTrainedModel (a SequentialLM of our pipeline layers, names `layers.N.layer.self_attn.q_b_proj`), so neither
applies reliably. Its `deepseek_v2` preset targets per-expert Linear names (`mlp.experts.0.up_proj`) while
transformers 5 stores the routed experts fused (3-D `gate_up_proj` / `down_proj` parameters, no Linear), which
AutoTP then leaves alone; the specs below say that explicitly (routed experts replicated in the TP group).

The split attention computes with num_heads / tp heads although it read num_heads from the config: transformers 5's
MLA, Llama and Qwen2 attention reshape the projections' outputs as (batch, seq, -1, head_dim), so the head count follows
the shard (tested: the TP=2 losses equal the unsplit reference).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from deepspeed.module_inject.layers import TensorParallel_Layer
from deepspeed.utils import groups
from torch import nn

from ..utils.private_api import init_tensor_parallel_mesh
from .registry import family_of

# Column-parallel: the output features (whole heads, whole MLP channels) are split; row-parallel: the input features,
# followed by an all-reduce of the output. Every other weight is replicated in the TP group. The attention's specs are
# each family's (tp_attention_specs).
_MLP_SPECS = [
    # Dense MLP (the dense first layers of V2/V3, every Llama / Qwen2 layer) and DeepSeekMoE's shared experts.
    {"patterns": [r".*\.mlp\.(shared_experts\.)?(gate|up)_proj\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.mlp\.(shared_experts\.)?down_proj\.weight$"], "partition_type": "row"},
]


def partition_config(model_type: str) -> dict:
    """AutoTP's `partition_config` for a model family (only these specs: DeepSpeed's defaults are not merged)."""
    return {"use_default_specs": False, "layer_specs": list(family_of(model_type).tp_attention_specs) + _MLP_SPECS}


def tensor_parallel_section(model_type: str, tp: int) -> dict:
    """DeepSpeed's `tensor_parallel` section (AutoTP training) for `tp` ranks per replica."""
    return {"autotp_size": tp, "partition_config": partition_config(model_type)}


def init_tensor_parallel_groups(tp: int):
    """DeepSpeed's data x tensor mesh (ranks r*tp .. r*tp+tp-1 form one replica's TP group), made before
    deepspeed.initialize and passed to it as `mpu`: its config otherwise counts every rank as data-parallel (the
    batch arithmetic fails). It is the mesh the engine's AutoTP uses (HF Trainer's tp_model_init path makes it the
    same way)."""
    init_tensor_parallel_mesh(tp)
    return groups


def split_dim(name: str, model_type: str) -> int | None:
    """The dimension of parameter `name` that AutoTP splits (0: column-parallel, 1: row-parallel), None: replicated.
    The specs name weights; AutoTP splits a column-parallel layer's bias with its output features (Qwen2's q/k/v
    biases) and keeps a row-parallel layer's whole (it is added after the all-reduce)."""
    bias = name.endswith(".bias")
    weight = name.removesuffix(".bias") + ".weight" if bias else name
    for spec in partition_config(model_type)["layer_specs"]:
        if any(re.match(p, weight) for p in spec["patterns"]):
            dim = {"column": 0, "row": 1}.get(spec["partition_type"])
            return None if bias and dim == 1 else dim
    return None


def shard_elements(module: nn.Module) -> dict[str, int]:
    """Elements of this rank's weights of the split (AutoTP) layers, by parameter name."""
    return {f"{name}.{p_name}" if p_name else name: p.numel()
            for name, layer in module.named_modules() if isinstance(layer, TensorParallel_Layer)
            for p_name, p in layer.named_parameters(recurse=False)}


# ----------------------------------------------------------------------------------------------- MLA rope key
def sum_rope_key_grads(module: nn.Module, group) -> int:
    """MLA's rotary key (the last qk_rope_head_dim outputs of kv_a_proj_with_mqa) is one vector shared by every
    head, so with the heads split each TP rank's backward gives it only its own heads' share of the gradient.
    DeepSpeed's MLA preset leaves that partial (it replicates the projection), which would corrupt the gradient of
    the projection and of everything below it; the hook sums that slice over the TP group (the compressed-KV slice
    is already whole: kv_b_proj's column-parallel backward all-reduces it). Returns the projections hooked."""
    hooked = 0
    for layer in module.modules():
        proj = getattr(layer, "kv_a_proj_with_mqa", None)
        if isinstance(proj, nn.Linear) and hasattr(layer, "qk_rope_head_dim"):
            proj.register_forward_hook(_rope_grad_hook(layer.qk_rope_head_dim, group))
            hooked += 1
    return hooked


def _rope_grad_hook(rope_dim: int, group):
    def hook(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        latent, rope = output[..., :-rope_dim], output[..., -rope_dim:]
        return torch.cat([latent, _SumGradOverGroup.apply(rope, group)], dim=-1)
    return hook


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group`. (DeepSpeed's ColumnParallel does the same but
    all-reduces `grad.contiguous()` and returns the original: a strided gradient, as a slice gets, stays partial.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# ----------------------------------------------------------------------------------------------- refusals
def tensor_parallel_errors(tp: int, *, pipeline_stages: int, expert_parallel: int, zero_stage: int,
                           heads: int, kv_heads: int, intermediate_sizes: dict[str, int], lora: bool,
                           mtp_depth: int) -> list[str]:
    """What a tensor-parallel layout of `tp` ranks cannot do, one line each naming the field and the fix."""
    if tp == 1:
        return []
    errors = []
    if zero_stage == 3:
        errors.append("parallel.tensor_parallel > 1 with ZeRO stage 3: deepseek-ds supports DeepSpeed AutoTP "
                      "training with ZeRO 0-2 only; use ds_configs/zero1.json or zero2.json")
    if pipeline_stages > 1:
        errors.append(f"parallel.tensor_parallel ({tp}) with parallel.pipeline_stages ({pipeline_stages}): DeepSpeed "
                      "0.19.8's AutoTP builds its data x tensor mesh over the whole world, apart from the pipeline "
                      "engine's grid, so the pipeline engine cannot carry it; set one of them to 1")
    if expert_parallel > 1:
        errors.append(f"parallel.tensor_parallel ({tp}) with parallel.expert_parallel ({expert_parallel}): DeepSpeed "
                      "0.19.8's AutoEP + AutoTP folding is not wired into deepseek-ds; set one of them to 1")
    if lora:
        errors.append("parallel.tensor_parallel > 1 with lora.r > 0: AutoTP would split the base layers under "
                      "peft's adapters; train LoRA with parallel.tensor_parallel: 1")
    if mtp_depth:
        errors.append(f"parallel.tensor_parallel > 1 with {mtp_depth} MTP module(s): their loss metrics are summed "
                      "over every rank, not per replica; set model.overrides.num_nextn_predict_layers: 0 or "
                      "parallel.tensor_parallel: 1")
    if tp > heads or heads % tp or kv_heads % tp:
        errors.append(f"parallel.tensor_parallel ({tp}) must divide the attention heads (num_attention_heads "
                      f"{heads}, num_key_value_heads {kv_heads}): TP splits whole heads; choose a divisor of "
                      f"{math.gcd(heads, kv_heads)}")
    for field, size in intermediate_sizes.items():
        if size % tp:
            errors.append(f"parallel.tensor_parallel ({tp}) must divide {field} ({size}): TP splits the MLP "
                          "channels evenly; choose a divisor of it")
    return errors
