"""Per-layer expert load and router-bias statistics of MoE models, for the per-step metrics.

The load is the one counter of models/moe.py (`ExpertLoad`, a forward hook on each router, shared with the load
balancer when there is one). Counts stay on the device during the step; `local_load()` and `local_bias()` pack
them, the training loop reduces them over ranks with the step's other metrics and reads them to the host once
(`metrics()`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.layers import DecoderLayerPipe, mtp_depth
from ..models.moe import ExpertLoad, LoadReader, router_bias
from ..models.presets import first_moe_layer, is_moe
from ..models.registry import family_of

BIAS_STATS = ("min", "max", "mean", "std")


def moe_layer_indices(config) -> list[int]:
    """Decoder layers with routed experts (transformers' rule: every layer from first_k_dense_replace on), and the
    MTP modules' (numbered on after the decoder layers, as in the published checkpoints)."""
    if not is_moe(config):
        return []
    return list(range(first_moe_layer(config), config.num_hidden_layers + mtp_depth(config)))


class RouterStats:
    """Tokens per routed expert for the MoE layers this rank holds: `local_load()` (summed over all ranks) and
    `local_bias()` (maxed) once per step give `metrics()`, flat and keyed moe/layer{i}/...
    load: the model's ExpertLoad if it has one already (the load balancer's); else one is attached here.
    counts_load: false on the ranks whose tokens another rank counts already (tensor-parallel peers)."""

    def __init__(self, module: nn.Module, config, device, reports_bias: bool, load: ExpertLoad | None = None,
                 counts_load: bool = True):
        self.layers = moe_layer_indices(config)
        self.num_experts = int(config.n_routed_experts)
        self.has_bias = family_of(config).has_router_bias  # V2's softmax router has no correction bias
        # Every data-parallel replica holds the same bias: one replica (dp rank 0) reports it, the MAX over ranks.
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

    @property
    def load_size(self) -> int:
        return len(self.layers) * self.num_experts

    def local_load(self) -> torch.Tensor:
        """This rank's tokens per routed expert since the previous call, flat (MoE layer x expert, zeros for the
        layers it does not hold): summed over all ranks, the step's load (metrics(), own_rows())."""
        counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64, device=self.device)
        taken = self._load.take()  # read either way: it starts the next step's count
        if self.counts_load:
            counts[self._rows] = taken
        return counts.flatten()

    def own_rows(self, summed_load: torch.Tensor) -> torch.Tensor:
        """The rows of local_load() summed over all ranks that are this rank's MoE blocks, in the load's block
        order (what the load balancer's bias update takes)."""
        return summed_load.view(len(self.layers), self.num_experts)[self._rows]

    def local_bias(self) -> torch.Tensor:
        """The router bias statistics (BIAS_STATS per MoE layer), flat, for a MAX over all ranks: one rank reports
        each layer (every data-parallel replica holds the same bias), every other entry is -inf. Empty for V2's
        routers, which have no bias."""
        stats = torch.full((len(self.layers) if self.has_bias else 0, len(BIAS_STATS)), -math.inf,
                           dtype=torch.float64, device=self.device)
        if self.has_bias and self.reports_bias:
            for row, router in self._routers.items():
                b = router_bias(router)
                if b is None:
                    stats[row] = 0.0
                else:
                    b = b.detach().double()
                    stats[row] = torch.stack([b.min(), b.max(), b.mean(), b.std(unbiased=False)])
        return stats.flatten()

    def metrics(self, load: list[float], bias: list[float]) -> dict[str, float]:
        """Flat metrics from local_load() summed and local_bias() maxed over all ranks (read to the host)."""
        out: dict[str, float] = {}
        for row, layer in enumerate(self.layers):
            c = load[row * self.num_experts:(row + 1) * self.num_experts]
            mean, peak = sum(c) / len(c), max(c)
            key = f"moe/layer{layer}"
            out[f"{key}/load_max"], out[f"{key}/load_mean"] = peak, mean
            # max/mean: 1.0 is perfect balance; num_experts / top_k means every token went to the same experts.
            out[f"{key}/load_ratio"] = peak / mean if mean > 0 else float("nan")
            if self.has_bias:
                stats = bias[row * len(BIAS_STATS):(row + 1) * len(BIAS_STATS)]
                for name, value in zip(BIAS_STATS, stats):
                    out[f"{key}/bias_{name}"] = value
        if self.layers:
            out["moe/load_ratio_max"] = max(out[f"moe/layer{layer}/load_ratio"] for layer in self.layers)
        return out
