"""The parameters one rank of a layout trains, counted on the meta device from the same layer specs and partition
the run builds (models.pipeline), in DeepSpeed's order: a pipeline stage registers its tied modules first, then its
layers; expert parallelism (AutoEP) keeps 1/EP of each MoE layer's routed experts in a parameter group of their own;
tensor parallelism (AutoTP) keeps 1/TP of each matrix models.tensor_parallel splits."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from deepspeed.pipe import TiedLayerSpec

from ..models.flops import LayerCost
from ..models.pipeline import layer_costs, layer_specs, partition
from ..models.tensor_parallel import split_dim

# transformers 5 stores a MoE layer's routed experts fused, as 3-D parameters under `mlp.experts`.
_ROUTED = re.compile(r"\.mlp\.experts\.")
_ROUTER = re.compile(r"\.mlp\.gate\.")


@dataclass(frozen=True)
class Param:
    name: str
    numel: int     # elements this rank holds (after the EP / TP split)
    expert: bool   # a routed-expert weight in AutoEP's own parameter group (expert_parallel > 1)
    trainable: bool = True  # False: a base weight LoRA freezes (no gradient, no optimizer state)


class SpecParams:
    """(name, elements, shape) of every spec's parameters, each spec built once on the meta device (no memory, any
    size), and the model's per-layer costs and stage partitions, computed once: a search asks for them per layout."""

    def __init__(self, mcfg):
        self.mcfg = mcfg
        self.specs = layer_specs(mcfg, seed=None)
        self._built: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}
        self._bounds: dict[tuple, list[int]] = {}
        self._costs: list[LayerCost] | None = None

    @property
    def costs(self) -> list[LayerCost]:
        self._costs = self._costs or layer_costs(self.mcfg)
        return self._costs

    def bounds(self, pp: int, method: str, seq_len: int) -> list[int]:
        """Spec indices of each stage's layers (one stage: all of them), as build_run partitions the model."""
        key = (pp, method, seq_len)
        if key not in self._bounds:
            self._bounds[key] = [0, len(self.specs)] if pp == 1 else partition(self.mcfg, pp, method, seq_len)
        return self._bounds[key]

    def __getitem__(self, index: int) -> list[tuple[str, int, tuple[int, ...]]]:
        if index not in self._built:
            with torch.device("meta"):
                layer = self.specs[index].build()
            self._built[index] = [(name, p.numel(), tuple(p.shape)) for name, p in layer.named_parameters()]
        return self._built[index]


def rank_params(model: SpecParams, bounds: list[int], stage: int, ep: int, tp: int, lora_r: int = 0,
                lora_targets: frozenset[str] = frozenset()) -> list[Param]:
    """The parameters of one rank of pipeline stage `stage`, in the order DeepSpeed flattens them.
    Without a pipeline (SequentialLM) a tied spec's later uses hold no parameters; a pipeline stage builds each tied
    module it uses once and registers it before its layers."""
    specs = model.specs
    a, b = bounds[stage], bounds[stage + 1]
    pipeline = len(bounds) > 2
    tied, layers, seen = [], [], set()
    for i in range(a, b):
        spec = specs[i]
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue
            seen.add(spec.key)
            (tied if pipeline else layers).extend((f"tied_modules.{spec.key}.{n}", k, sh) for n, k, sh in model[i])
        else:
            layers.extend((f"{i}.{n}", k, sh) for n, k, sh in model[i])
    out, replaced = [], []
    for name, numel, shape in tied + layers:
        if lora_r:
            out.extend(_lora(name, numel, shape, lora_r, lora_targets, ep))
        elif ep > 1 and _ROUTED.search(name):
            replaced.extend(_autoep_experts(name, numel // ep))
        elif ep > 1 and _ROUTER.search(name):
            replaced.append(Param(name, numel, expert=False))
        else:
            split = tp > 1 and split_dim(name, model.mcfg.model_type) is not None
            out.append(Param(name, numel // tp if split else numel, expert=False))
    # AutoEP swaps each MoE block for its own module; DeepSpeed drops the swapped parameters (routed experts and the
    # router) from the optimizer's list and appends their replacements at its end, layer by layer.
    return out + replaced


def _lora(name: str, numel: int, shape: tuple[int, ...], r: int, targets: frozenset[str], ep: int) -> list[Param]:
    """A base weight, frozen, and, on a targeted linear layer (peft matches the module name's last part), its adapters
    A (r x in) and B (out x r): r x (in + out) trainable elements. Routed experts are fused 3-D weights, no Linear."""
    module = name.rsplit(".", 2)
    frozen = Param(name, numel // ep if ep > 1 and _ROUTED.search(name) else numel, expert=False, trainable=False)
    if len(shape) != 2 or name.rsplit(".", 1)[-1] != "weight" or module[-2] not in targets:
        return [frozen]
    out_features, in_features = shape
    return [frozen, Param(name + ".lora_A", r * in_features, False), Param(name + ".lora_B", out_features * r, False)]


def _autoep_experts(name: str, numel: int) -> list[Param]:
    """AutoEP's w1, w2, w3 (gate, down, up: each experts x hidden x intermediate) of one rank's experts, from
    transformers' fused gate_up_proj (w1 and w3) and down_proj (w2), `numel` already 1/EP."""
    if name.endswith("gate_up_proj"):
        return [Param(name + ".w1", numel // 2, True)]
    return [Param(name + ".w2", numel, True), Param(name + ".w3", numel, True)]
