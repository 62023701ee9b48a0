"""The parameters one rank of a layout trains, counted on the meta device from the same layer specs and partition
the run builds (models.pipeline), in DeepSpeed's order: a pipeline stage registers its tied modules first, then its
layers; expert parallelism (AutoEP) keeps 1/EP of each MoE layer's routed experts in a parameter group of their own;
tensor parallelism (AutoTP) keeps 1/TP of each matrix models.tensor_parallel splits. With LoRA, the whole model is built
on the meta device and models.lora.apply_lora adapts it as training does: its requires_grad flags are the trainable
parameters (adapters on the targets and the routed experts, lora.modules_to_save in full); under AutoEP the routed
experts' adapters go with their experts, 1/EP per rank in the expert group. Parameters a layer itself freezes
(DeepSeek-V4's lightning indexers, requires_grad False from the family's prepare_layer) are frozen as LoRA's base is:
no gradient, no optimizer state, outside ZeRO's flat groups. DeepSeek-V3.2's indexers, frozen the same way by default,
train with indexer.stage warmup (they alone: everything else frozen) or sparse (with everything else), as
models.deepseek_v32.indexer.train_indexers leaves the built layers. Each parameter also carries whether Muon updates it
(models/muon.py's rule, applied to the built layer), for a DeepSpeed JSON that selects Muon."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from ..models.deepseek_v32.indexer import train_indexers
from ..models.flops import LayerCost
from ..models.lora import apply_lora
from ..models.muon import muon_split
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
    trainable: bool = True  # False: a base weight LoRA freezes or a frozen layer part (no gradient or optimizer state)
    muon_shape: tuple[int, ...] = ()  # its shape if Muon updates it under a Muon JSON (models/muon.py's rule)

    @property
    def muon(self) -> bool:
        return bool(self.muon_shape)


class SpecParams:
    """(name, elements) of every spec's parameters, each spec built once on the meta device (no memory, any
    size), and the model's per-layer costs and stage partitions, computed once: a search asks for them per layout."""

    def __init__(self, mcfg):
        self.mcfg = mcfg
        self.specs = layer_specs(mcfg, seed=None)
        self._built: dict[int, list[tuple[str, int, bool]]] = {}
        self._muon: dict[int, dict[str, tuple[int, ...]]] = {}
        self._bounds: dict[tuple, list[int]] = {}
        self._costs: list[LayerCost] | None = None
        self._lora: dict[tuple, list[list[tuple[str, int, bool]]]] = {}
        self._indexed: dict[tuple[int, str], list[tuple[str, int, bool]]] = {}

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

    def __getitem__(self, index: int) -> list[tuple[str, int, bool]]:
        """(name, elements, trainable) of spec `index`'s parameters, trainable as the built layer's requires_grad."""
        self._build(index)
        return self._built[index]

    def muon(self, index: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of spec `index`'s parameters that Muon updates (the rule applied to the built layer)."""
        self._build(index)
        return self._muon[index]

    def _build(self, index: int) -> None:
        if index not in self._built:
            with torch.device("meta"):
                layer = self.specs[index].build()
            self._built[index] = [(name, p.numel(), p.requires_grad) for name, p in layer.named_parameters()]
            shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
            self._muon[index] = {name: shapes[name] for name, muon in muon_split(layer).items() if muon}

    def with_indexers(self, index: int, stage: str) -> list[tuple[str, int, bool]]:
        """(name, elements, trainable) of spec `index`'s parameters under indexer.stage `stage`: frozen as built;
        warmup or sparse as train_indexers leaves them."""
        if stage == "frozen":
            return self[index]
        if (index, stage) not in self._indexed:
            with torch.device("meta"):
                layer = self.specs[index].build()
            train_indexers(layer, stage)
            self._indexed[index, stage] = [(name, p.numel(), p.requires_grad) for name, p in layer.named_parameters()]
        return self._indexed[index, stage]

    def lora(self, section) -> list[list[tuple[str, int, bool]]]:
        """(name, elements, trainable) of every spec's parameters after apply_lora with the run's `lora` section."""
        key = (section.r, section.alpha, section.dropout, repr(section.target_modules),
               tuple(section.modules_to_save), section.routed_experts)
        if key not in self._lora:
            with torch.device("meta"):
                layers = nn.ModuleList(spec.build() for spec in self.specs)
                apply_lora(layers, section, self.mcfg, seed=0)
            self._lora[key] = [[(name, p.numel(), p.requires_grad) for name, p in layer.named_parameters()]
                               for layer in layers]
        return self._lora[key]


def lora_active(model: SpecParams, section) -> list[tuple[int, int]]:
    """Per spec, (frozen base weights, adapters): the elements a token's matmuls touch under LoRA (r > 0), as
    layer_costs counts active parameters (a lookup embedding none, an MoE layer's routed experts top-k of n)."""
    k, n = getattr(model.mcfg, "num_experts_per_tok", 0) or 0, getattr(model.mcfg, "n_routed_experts", 0) or 1

    def active(entries) -> int:
        return sum(e * k // n if _ROUTED.search(f".{name}") else e for name, e in entries)

    out = []
    for cost, entries in zip(model.costs, model.lora(section)):
        frozen = active((name, e) for name, e, trainable in entries if not trainable)
        adapters = active((name, e) for name, e, trainable in entries if trainable and ".lora_" in f".{name}")
        out.append((frozen if cost.active_params else 0, adapters))
    return out


def rank_params(model: SpecParams, bounds: list[int], stage: int, ep: int, tp: int, lora=None,
                indexer: str = "frozen") -> list[Param]:
    """The parameters of one rank of pipeline stage `stage`, in the order DeepSpeed flattens them; `lora`: the run's
    lora section (r > 0: the base frozen, what apply_lora unfreezes trainable); `indexer`: indexer.stage (which
    validate() refuses with LoRA).
    Without a pipeline (SequentialLM) a tied spec's later uses hold no parameters; a pipeline stage builds each tied
    module it uses once and registers it before its layers."""
    specs = model.specs
    adapted = model.lora(lora) if lora is not None and lora.r else None
    a, b = bounds[stage], bounds[stage + 1]
    pipeline = len(bounds) > 2
    tied, layers, seen = [], [], set()
    for i in range(a, b):
        spec = specs[i]
        entries = adapted[i] if adapted else model.with_indexers(i, indexer)
        muon = {} if adapted else model.muon(i)  # validate() refuses LoRA with Muon
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue
            seen.add(spec.key)
            (tied if pipeline else layers).extend((f"tied_modules.{spec.key}.{n}", k, t, muon.get(n, ()))
                                                  for n, k, t in entries)
        else:
            layers.extend((f"{i}.{n}", k, t, muon.get(n, ())) for n, k, t in entries)
    out, replaced = [], []
    for name, numel, trainable, muon in tied + layers:
        routed = ep > 1 and bool(_ROUTED.search(name))
        if adapted:
            # A rank holds its own experts (frozen, 1/EP) and, with lora.routed_experts, their adapters
            # (parallel/expert_lora.py: A and B rows of its experts, marked as AutoEP's expert weights), so ZeRO
            # shards them over the expert-data-parallel group; peft's fused (E r, in) adapters split evenly by expert.
            # training/parallelize.py hands LoRA's engine a generator, read after AutoEP's replacements: all in place.
            out.append(Param(name, numel // ep if routed else numel, routed, trainable))
        elif routed:
            replaced.extend(_autoep_experts(name, numel // ep))
        elif ep > 1 and _ROUTER.search(name):
            replaced.append(Param(name, numel, expert=False))
        else:
            split = tp > 1 and split_dim(name, model.mcfg.model_type) is not None
            out.append(Param(name, numel // tp if split else numel, expert=False, trainable=trainable, muon_shape=muon))
    # AutoEP swaps each MoE block for its own module; given a list, DeepSpeed drops the swapped parameters (routed
    # experts and the router) from the optimizer's list and appends their replacements at its end, layer by layer.
    return out + replaced


def _autoep_experts(name: str, numel: int) -> list[Param]:
    """AutoEP's w1, w2, w3 (gate, down, up: each experts x hidden x intermediate) of one rank's experts, from
    transformers' fused gate_up_proj (w1 and w3) and down_proj (w2), `numel` already 1/EP."""
    if name.endswith("gate_up_proj"):
        return [Param(name + ".w1", numel // 2, True)]
    return [Param(name + ".w2", numel, True), Param(name + ".w3", numel, True)]
