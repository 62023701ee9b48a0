"""Per-layer expert load and router-bias statistics of MoE models, for the per-step metrics.

A forward hook on each router sees every routing decision without touching the model code: transformers'
DeepseekV3TopkRouter / DeepseekV2TopkRouter return (router_logits, topk_weights, topk_indices), DeepSpeed
AutoEP's router (top_scores, selected_experts, tokens_per_expert). Counts stay on the device during the step
and cross to the host once, in the single all_reduce of `collect()`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from deepspeed.moe.ep_router import TokenChoiceTopKRouter
from torch import nn

from ..models.layers import DecoderLayerPipe, mtp_depth
from ..models.moe import HF_ROUTERS, router_bias
from ..models.presets import is_moe

BIAS_STATS = ("min", "max", "mean", "std")


def moe_layer_indices(config) -> list[int]:
    """Decoder layers with routed experts (transformers' rule: every layer from first_k_dense_replace on), and the
    MTP modules' (numbered on after the decoder layers, as in the published checkpoints)."""
    if not is_moe(config):
        return []
    return list(range(config.first_k_dense_replace, config.num_hidden_layers + mtp_depth(config)))


def _router_of(layer: DecoderLayerPipe) -> tuple[nn.Module, int] | None:
    """(router, position of the chosen experts in its output): transformers' at mlp.gate, AutoEP's at mlp.router."""
    mlp = layer.layer.mlp
    if isinstance(getattr(mlp, "gate", None), HF_ROUTERS):
        return mlp.gate, 2
    if isinstance(getattr(mlp, "router", None), TokenChoiceTopKRouter):
        return mlp.router, 1
    return None


def _in_backward() -> bool:
    # Activation checkpointing re-runs forwards (and their hooks) inside backward; those must not count twice.
    # torch.utils.checkpoint itself tells the two apart this way.
    return torch._C._current_graph_task_id() != -1


class RouterStats:
    """Counts tokens per routed expert for the MoE layers this rank holds; `collect()` (a collective: every
    rank calls it once per step) combines all ranks and returns flat metrics keyed moe/layer{i}/..."""

    def __init__(self, module: nn.Module, config, device, reports_bias: bool):
        self.layers = moe_layer_indices(config)
        self.num_experts = int(config.n_routed_experts)
        self.has_bias = config.model_type == "deepseek_v3"  # V2's softmax router has no correction bias
        # Every data-parallel replica holds the same bias: one replica (dp rank 0) reports it, so the sum is exact.
        self.reports_bias = reports_bias
        self._counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64, device=device)
        self._routers: dict[int, nn.Module] = {}
        row_of = {layer: row for row, layer in enumerate(self.layers)}
        for m in module.modules():
            found = _router_of(m) if isinstance(m, DecoderLayerPipe) else None
            if found:
                router, position = found
                row = row_of[m.layer_idx]
                self._routers[row] = router
                router.register_forward_hook(partial(self._count, row, position))

    def _count(self, row: int, position: int, module: nn.Module, _args, output) -> None:
        if not module.training or _in_backward():
            return  # evaluation forwards and checkpoint recomputation are not training traffic
        self._counts[row] += torch.bincount(output[position].reshape(-1), minlength=self.num_experts)

    def _local_bias(self) -> torch.Tensor:
        stats = torch.zeros(len(self.layers), len(BIAS_STATS), dtype=torch.float64, device=self._counts.device)
        if self.has_bias and self.reports_bias:
            for row, router in self._routers.items():
                b = router_bias(router)
                if b is not None:
                    b = b.detach().double()
                    stats[row] = torch.stack([b.min(), b.max(), b.mean(), b.std(unbiased=False)])
        return stats

    def collect(self) -> dict[str, float]:
        """Metrics of the step that just ended (summed over all ranks), then reset the counts."""
        packed = torch.cat([self._counts.double().flatten(), self._local_bias().flatten()])
        if dist.is_initialized():
            dist.all_reduce(packed)
        self._counts.zero_()
        n = len(self.layers) * self.num_experts
        counts = packed[:n].view(len(self.layers), self.num_experts).cpu()
        bias = packed[n:].view(len(self.layers), len(BIAS_STATS)).cpu()
        out: dict[str, float] = {}
        for row, layer in enumerate(self.layers):
            c = counts[row]
            mean, peak = float(c.mean()), float(c.max())
            key = f"moe/layer{layer}"
            out[f"{key}/load_max"], out[f"{key}/load_mean"] = peak, mean
            # max/mean: 1.0 is perfect balance; num_experts / top_k means every token went to the same experts.
            out[f"{key}/load_ratio"] = peak / mean if mean > 0 else float("nan")
            if self.has_bias:
                for name, value in zip(BIAS_STATS, bias[row].tolist()):
                    out[f"{key}/bias_{name}"] = value
        if self.layers:
            out["moe/load_ratio_max"] = max(out[f"moe/layer{layer}/load_ratio"] for layer in self.layers)
        return out
