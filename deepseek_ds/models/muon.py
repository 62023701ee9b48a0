"""Muon (DeepSpeed's `"optimizer": {"type": "Muon"}`, MuonWithAuxAdam): THE rule that says which parameters Muon
updates and which the auxiliary AdamW does, and the tagging that makes DeepSpeed's optimizer follow it.

The rule: Muon for every matrix inside the decoder layers and the MTP layers (attention projections, dense and
shared-expert MLPs, routers, MTP's eh_proj; each routed expert's gate, up and down projections, which transformers
fuses into 3-D tensors and AutoEP holds as w1, w3 and w2), AdamW for
the embedding, the output head and every 1-D parameter (norms, biases) and any other parameter outside those layers
(DeepSeek-V4's hc_head).

DeepSpeed tags `use_muon` itself (deepspeed.set_optimizer_flags: any >= 2-D parameter whose name lacks "embed" and
"lm_head"), and again after AutoEP replaces the experts; this module's tags are applied last, as the engine builds
its optimizer, so the rule here is the one that trains. DeepSpeed's Muon scales each matrix's orthogonalised
update by sqrt(max(1, rows / cols)) (torch.optim.Muon's "original" learning-rate adjustment), and a 3-D tensor
tagged `is_expert_group` is orthogonalised per expert; a fused gate_up_proj per expert and per projection
(MuonBlocks), so that one rank and expert parallelism (AutoEP's separate w1 and w3) orthogonalise the same matrices,
as the dense MLPs' separate gate_proj and up_proj are. The engine's ZeRO optimizer then runs Muon after the step's
gradient norm, on the gradient clipped by it (utils/private_optimizer.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from ..utils.private_api import CONFIGURE_OPTIMIZER, attribute_replaced
from ..utils.private_optimizer import MuonBlocks, muon_after_the_norm
from .layers import DecoderLayerPipe

MUON = "muon"
RULE = ("Muon for every matrix of the decoder and MTP layers (attention projections, dense and shared-expert MLPs, "
        "routers, MTP's eh_proj; each routed expert's gate, up and down projections), AdamW for the embedding, the "
        "output head and every 1-D parameter")
FUSED_GATE_UP = "gate_up_proj"  # transformers' routed experts: [E, 2I, H], each expert's gate and up stacked
PER_HEAD = "per_head_muon"  # DeepSpeed's Muon key (optimizer.params), which deepseek-ds applies itself
NS_PRECISION = "ns_precision"  # deepseek-ds's key (optimizer.params): "auto" (DeepSpeed's choice) or "fp32"
NS_PRECISIONS = ("auto", "fp32")
# MLA's projections whose rows are head after head (num_attention_heads blocks): the queries' (q_proj without a
# query LoRA, as in V2-Lite) and the keys' and values' up-projection.
PER_HEAD_PROJECTIONS = ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32")


def is_muon(ds: dict) -> bool:
    """Whether the DeepSpeed config selects DeepSpeed's Muon (its optimizer names are case-insensitive)."""
    optimizer = ds.get("optimizer")
    return isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() == MUON


def muon_params(ds: dict) -> dict:
    """A Muon config's optimizer.params ({} for another optimizer, or none given)."""
    return (ds["optimizer"].get("params") or {}) if is_muon(ds) else {}


def ns_precision(ds: dict) -> str:
    """A Muon config's optimizer.params.ns_precision ("auto" when not given)."""
    return muon_params(ds).get(NS_PRECISION, "auto")


def per_head(ds: dict) -> bool:
    """Whether a Muon config asks for per-head orthogonalisation of MLA's projections (optimizer.params.per_head_muon)."""
    return bool(muon_params(ds).get(PER_HEAD))


def ns_in_fp32(ds: dict) -> bool:
    """Whether a Muon config asks for Newton-Schulz in fp32 (optimizer.params.ns_precision: fp32)."""
    return ns_precision(ds) == "fp32"


def deepspeed_muon_config(ds: dict) -> dict:
    """The config DeepSpeed gets: the keys deepseek-ds applies itself left out: ns_precision (its own), and
    per_head_muon (DeepSpeed's own per-head tagging reads head counts from an HF model's config, which our layers do
    not carry, and its ZeRO 1/2 padded path drops them)."""
    params = muon_params(ds)
    if not {PER_HEAD, NS_PRECISION} & set(params):
        return ds
    kept = {k: v for k, v in params.items() if k not in (PER_HEAD, NS_PRECISION)}
    return {**ds, "optimizer": {**ds["optimizer"], "params": kept}}


def layer_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape as a layer: ZeRO-3's partitioned parameters are flat and keep it in ds_shape."""
    shape = getattr(p, "ds_shape", None)
    return tuple(p.shape if shape is None else shape)


def muon_split(model: torch.nn.Module) -> dict[str, bool]:
    """Parameter name -> whether Muon updates it (the rule above), for every parameter of `model` (a pipeline
    stage holds its own layers only)."""
    inside = {id(p) for m in model.modules() if isinstance(m, DecoderLayerPipe) for p in m.parameters()}
    return {name: id(p) in inside and len(layer_shape(p)) >= 2 for name, p in model.named_parameters()}


@dataclass(frozen=True)
class Split:
    muon_matrices: int   # Muon tensors (a fused expert tensor counts once)
    muon_elements: int
    adam_tensors: int
    adam_elements: int

    def describe(self) -> str:
        return (f"Muon: {self.muon_matrices} matrices ({self.muon_elements:,} elements); AdamW: {self.adam_tensors} "
                f"tensors ({self.adam_elements:,} elements)")


def _blocks(name: str, ndim: int, heads: int | None):
    """A Muon matrix's `is_expert_group` tag: MuonBlocks for a fused gate_up_proj (2 per expert) and, with `heads`
    (per-head Muon), for MLA's per-head projections; True for another 3-D tensor (per expert); else False."""
    if name.endswith(FUSED_GATE_UP):
        return MuonBlocks(2)
    if heads and name.endswith(PER_HEAD_PROJECTIONS):
        return MuonBlocks(heads)
    return ndim >= 3


def tag_muon(model: torch.nn.Module, heads: int | None = None) -> Split:
    """Sets `use_muon` on every parameter by the rule, and `is_expert_group` on Muon's 3-D tensors (fused routed
    experts: DeepSpeed then orthogonalises each expert's matrix on its own; a gate_up_proj's two, MuonBlocks) and,
    given the model's attention `heads` (per-head Muon), MuonBlocks(heads) on MLA's per-head projections; returns the
    trainable split."""
    split = muon_split(model)
    counts = [0, 0, 0, 0]
    for name, p in model.named_parameters():
        muon = split[name]
        p.use_muon = muon
        blocks = muon and _blocks(name, len(layer_shape(p)), heads)
        if blocks:
            p.is_expert_group = blocks
            p.muon_num_heads = blocks if isinstance(blocks, MuonBlocks) else None  # what ZeRO-3 passes muon_update
        if p.requires_grad:
            numel = getattr(p, "ds_numel", None) or p.numel()
            counts[0 if muon else 2] += 1
            counts[1 if muon else 3] += numel
    return Split(*counts)


@contextlib.contextmanager
def muon_tagging(log: logging.Logger, heads: int | None = None, fp32: bool = False) -> Iterator[None]:
    """Around deepspeed.initialize: the rule's tags replace DeepSpeed's just before the engine builds its optimizer
    (after its own tagging and AutoEP's replacements), and the ZeRO optimizer built runs Muon as the module
    docstring says (`heads`: per-head Muon, tag_muon; `fp32`: Newton-Schulz in fp32); `log` gets the split.
    DeepSpeed offers no hook between the two: its optimizer construction is patched for the block
    (utils/private_api.py)."""
    configure = getattr(DeepSpeedEngine, CONFIGURE_OPTIMIZER)

    def configure_optimizer(self, client_optimizer, model_parameters):
        log.info("optimizer Muon (the rule: deepseek_ds/models/muon.py): %s on this rank",
                 tag_muon(self.module, heads).describe())
        configure(self, client_optimizer, model_parameters)
        muon_after_the_norm(self.optimizer, fp32)

    with attribute_replaced(DeepSpeedEngine, CONFIGURE_OPTIMIZER, configure_optimizer):
        yield


def muon_context(ds: dict, heads: int, log: logging.Logger) -> contextlib.AbstractContextManager:
    """Around deepspeed.initialize: muon_tagging with the config's per-head and precision settings (`heads`: the
    model's attention heads), or nothing for another optimizer."""
    if not is_muon(ds):
        return contextlib.nullcontext()
    return muon_tagging(log, heads if per_head(ds) else None, ns_in_fp32(ds))
