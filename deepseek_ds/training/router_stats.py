"""Per-layer expert load and router-bias statistics of MoE models, for the per-step metrics.

The load is the one counter of models/moe.py (`ExpertLoad`, a forward hook on each router, shared with the load
balancer when there is one). Counts stay on the device during the step; `local()` packs them, the training loop
sums them over ranks together with the step's other metrics and reads them to the host once (`metrics()`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.layers import DecoderLayerPipe, mtp_depth
from ..models.moe import ExpertLoad, LoadReader, router_bias
from ..models.presets import is_moe

BIAS_STATS = ("min", "max", "mean", "std")


def moe_layer_indices(config) -> list[int]:
    """Decoder layers with routed experts (transformers' rule: every layer from first_k_dense_replace on), and the
    MTP modules' (numbered on after the decoder layers, as in the published checkpoints)."""
    if not is_moe(config):
        return []
    return list(range(config.first_k_dense_replace, config.num_hidden_layers + mtp_depth(config)))


class RouterStats:
    """Tokens per routed expert for the MoE layers this rank holds: `local()` once per step, summed over all ranks,
    gives `metrics()`, flat and keyed moe/layer{i}/...
    load: the model's ExpertLoad if it has one already (the load balancer's); else one is attached here.
    counts_load: false on the ranks whose tokens another rank counts already (tensor-parallel peers)."""

    def __init__(self, module: nn.Module, config, device, reports_bias: bool, load: ExpertLoad | None = None,
                 counts_load: bool = True):
        self.layers = moe_layer_indices(config)
        self.num_experts = int(config.n_routed_experts)
        self.has_bias = config.model_type == "deepseek_v3"  # V2's softmax router has no correction bias
        # Every data-parallel replica holds the same bias: one replica (dp rank 0) reports it, so the sum is exact.
        self.reports_bias = reports_bias
        self.counts_load = counts_load
        self.device = device
        if load is None:
            load = ExpertLoad(module, self.num_experts, device)
        self._load = LoadReader(load)
        # The load's rows are this rank's MoE blocks; ours are every MoE layer of the model (zeros where absent).
        row_of = {layer: row for row, layer in enumerate(self.layers)}
        layer_of = {id(m.layer.mlp): m.layer_idx for m in module.modules() if isinstance(m, DecoderLayerPipe)}
        rows = [row_of[layer_of[id(block)]] for block, _ in load.blocks.values()]
        self._rows = torch.tensor(rows, dtype=torch.long, device=device)
        self._routers = {row: router for row, (_, router) in zip(rows, load.blocks.values())}

    def _local_bias(self) -> torch.Tensor:
        stats = torch.zeros(len(self.layers), len(BIAS_STATS), dtype=torch.float64, device=self.device)
        if self.has_bias and self.reports_bias:
            for row, router in self._routers.items():
                b = router_bias(router)
                if b is not None:
                    b = b.detach().double()
                    stats[row] = torch.stack([b.min(), b.max(), b.mean(), b.std(unbiased=False)])
        return stats

    def local(self) -> torch.Tensor:
        """This rank's part of the step's statistics, flat (the load since the previous call, the bias statistics):
        summed over all ranks, metrics() reads it."""
        counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64, device=self.device)
        taken = self._load.take()  # read either way: it starts the next step's count
        if self.counts_load:
            counts[self._rows] = taken
        return torch.cat([counts.flatten(), self._local_bias().flatten()])

    def metrics(self, summed: torch.Tensor) -> dict[str, float]:
        """Flat metrics from local() summed over all ranks (a host tensor)."""
        n = len(self.layers) * self.num_experts
        counts = summed[:n].view(len(self.layers), self.num_experts)
        bias = summed[n:].view(len(self.layers), len(BIAS_STATS))
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
