"""LoRA under DeepSpeed's AutoEP: adapters on the routed experts that live with their experts' shard, and frozen
experts at all. Written here because neither peft nor DeepSpeed does it: AutoEP replaces each MoE block by its
AutoEPMoELayer, copying this rank's experts out of transformers' fused tensors into grouped `w1` (gate), `w3` (up),
`w2` (down) tensors (E_local, out, in), a module peft cannot adapt, and it finds no experts behind peft's wrapper.

- Before deepspeed.initialize, `detach_peft_experts` puts transformers' experts module back in place of peft's
  ParamWrapper chain (target_parameters) and keeps the wrapper's adapters, seeded as on one process, beside it.
- While deepspeed.initialize runs (`autoep_lora`), each replacement's experts get this rank's rows of them as
  parameters A (E_local, r, in), B (E_local, out, r), marked as AutoEP marks its expert weights, so ZeRO reduces
  them over the expert-data-parallel group and each EP rank's optimizer holds only its experts' adapters; their
  forward folds W + scaling * B @ A per expert into AutoEP's own grouped GEMM (peft folds the same way: its
  target_parameters adapters have no dropout, so this is exact).
- With every expert frozen (attention-only adapters) DeepSpeed's ZeRO optimizer asserts that an MoE model has an
  expert parameter group; the optimizer is then built as a dense model's, which it is for what trains.

peft's layout of one fused tensor's adapter (num_experts E, rank r): lora_A (E r, in) is A_e = A.view(E, r, in)[e],
lora_B (out, r E) is B_e = B.view(out, r, E)[:, :, e]; delta W_e = scaling B_e A_e. `to_peft` converts back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from deepspeed.module_inject.auto_ep import AutoEP
from deepspeed.moe.ep_experts import GroupedExperts
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.engine import DeepSpeedEngine
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from ..models.lora import ADAPTER, ROUTED_EXPERT_PARAMETERS
from ..models.names import hf_name
from ..utils.private_api import AUTOEP_REPLACE_MOE_LAYER, CONFIGURE_OPTIMIZER, attribute_replaced, experts_kernel

_FACTORS = "_expert_lora"  # attribute of transformers' experts module: {parameter name: (A, B, scaling)}
FUSED = ("gate_up_proj", "down_proj")  # transformers' fused expert tensors, as peft's target_parameters name them


def detach_peft_experts(model: nn.Module) -> int:
    """Replace every peft ParamWrapper chain on a routed-experts module by the experts module itself, keeping each
    adapter (A (E, r, in), B (E, out, r), scaling) on it for autoep_lora; returns the number of MoE blocks."""
    count = 0
    for module in list(model.modules()):
        wrapper = getattr(module, "experts", None)
        if not isinstance(wrapper, ParamWrapper):
            continue
        factors = {}
        while isinstance(wrapper, ParamWrapper):
            a, b = wrapper.lora_A[ADAPTER].weight.detach(), wrapper.lora_B[ADAPTER].weight.detach()
            e = wrapper.num_experts
            factors[wrapper.parameter_name] = (a.reshape(e, -1, a.shape[-1]),
                                               b.reshape(b.shape[0], -1, e).permute(2, 0, 1), wrapper.scaling[ADAPTER])
            wrapper = wrapper.base_layer
        setattr(wrapper, _FACTORS, factors)
        module.experts = wrapper
        count += 1
    return count


def to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts' A (E, r, in), B (E, out, r) -> peft's lora_A (E r, in), lora_B (out, r E)."""
    return a.reshape(-1, a.shape[-1]), b.permute(1, 2, 0).reshape(b.shape[1], -1)


class LoraGroupedExperts(GroupedExperts):
    """AutoEP's grouped experts with per-expert adapters on the fused gate/up (w1, w3) and down (w2) weights."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        ffn = self.w1.shape[1]
        gate_up = torch.bmm(self.lora_B_gate_up_proj, self.lora_A_gate_up_proj)  # transformers' (E, 2 ffn, hidden)
        w1 = self.w1 + self.lora_scaling_gate_up_proj * gate_up[:, :ffn]  # AutoEP's w1 is gate_up[:, :ffn], w3 the rest
        w3 = self.w3 + self.lora_scaling_gate_up_proj * gate_up[:, ffn:]
        w2 = torch.baddbmm(self.w2, self.lora_B_down_proj, self.lora_A_down_proj, alpha=self.lora_scaling_down_proj)
        act = (self.activation, self.activation_alpha, self.activation_limit)
        # GroupedExperts.forward's dispatch, with the adapted weights
        return experts_kernel(self)(w1, w2, w3, x, num_tokens_per_expert, *act)


def _attach(replacement: nn.Module, source: nn.Module, experts_name: str, ep_rank: int) -> None:
    factors = getattr(getattr(source, experts_name), _FACTORS, None)
    if not factors:
        return
    experts, n = replacement.experts, replacement.num_local_experts
    rows = slice(ep_rank * n, (ep_rank + 1) * n)  # AutoEP's uniform placement (its ep_repack module's expert range)
    for fused in FUSED:
        a, b, scaling = factors[fused]
        for kind, full in (("A", a), ("B", b)):
            # contiguous: DeepSpeed broadcasts parameters as byte views
            p = nn.Parameter(full[rows].to(experts.w1.dtype).contiguous())
            # AutoEPMoELayer's marks of its expert weights (module_inject/auto_ep_layer.py)
            p.allreduce = False
            p.group_name = replacement.ep_group_name
            p.ds_zero_placement_family = "autoep_expert"
            p.ds_zero_partition_group_name = replacement.ep_group_name
            experts.register_parameter(f"lora_{kind}_{fused}", p)
        setattr(experts, f"lora_scaling_{fused}", float(scaling))
    experts.first_expert = rows.start  # where this rank's rows sit among all experts (checkpoints and export)
    experts.__class__ = LoraGroupedExperts


@contextlib.contextmanager
def autoep_lora() -> Iterator[None]:
    """Around deepspeed.initialize of a LoRA model with AutoEP: replacements take their experts' adapters, and an
    optimizer over frozen experts is built as a dense model's. Both are DeepSpeed methods patched for the block only
    (AutoEP and ZeRO offer no hook for either)."""
    replace, configure = getattr(AutoEP, AUTOEP_REPLACE_MOE_LAYER), getattr(DeepSpeedEngine, CONFIGURE_OPTIMIZER)

    def replace_with_adapters(self, spec, ep_size, ep_rank, collect_sources=False):
        source = self.model.get_submodule(spec.moe_module_name)
        replacement, sources = replace(self, spec, ep_size, ep_rank, collect_sources)
        _attach(replacement, source, spec.experts_name, ep_rank)
        return replacement, sources

    def configure_optimizer(self, client_optimizer, model_parameters):
        if not self.has_moe_layers or any(p.requires_grad and is_moe_param(p) for p in self.module.parameters()):
            return configure(self, client_optimizer, model_parameters)
        self.has_moe_layers = False  # read again by its MoE checkpointing, after this
        try:
            return configure(self, client_optimizer, model_parameters)
        finally:
            self.has_moe_layers = True

    with attribute_replaced(AutoEP, AUTOEP_REPLACE_MOE_LAYER, replace_with_adapters), \
            attribute_replaced(DeepSpeedEngine, CONFIGURE_OPTIMIZER, configure_optimizer):
        yield


FIRST = "first_expert"
_KEYS = tuple(f"lora_{kind}_{fused}" for fused in FUSED for kind in "AB")


def adapter_rows(layers) -> dict[str, dict]:
    """HF name of each adapted experts module of these pipeline layers -> {FIRST: its first expert's index, lora_*:
    this rank's rows as fp32 (ZeRO's master copies: a collective over each expert-data-parallel group)}."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for layer in layers:
        for name, m in layer.named_modules():
            if isinstance(m, LoraGroupedExperts):
                out[hf_name(layer, name)] = {FIRST: m.first_expert, **{
                    key: safe_get_full_fp32_param(getattr(m, key)).detach().float().cpu().clone() for key in _KEYS}}
    return out


def restore_rows(layers, saved: dict[str, dict]) -> None:
    """Put this rank's saved rows back into its adapted experts modules (DeepSpeed's model-states file holds one
    rank's rows under names every rank shares, so its load gives every rank those)."""
    for layer in layers:
        for name, m in layer.named_modules():
            if isinstance(m, LoraGroupedExperts):
                rows = saved[hf_name(layer, name)]
                if rows[FIRST] != m.first_expert:
                    raise ValueError(f"{hf_name(layer, name)}: saved rows start at expert {rows[FIRST]}, this rank's "
                                     f"at {m.first_expert}")
                with torch.no_grad():
                    for key in _KEYS:
                        getattr(m, key).copy_(rows[key])


def peft_tensors(parts: list[dict[str, dict]]) -> dict[str, torch.Tensor]:
    """Every expert-parallel rank's adapter_rows -> peft's tensors of all experts by HF name (peft nests its
    ParamWrappers in ROUTED_EXPERT_PARAMETERS order, the last outermost: the earlier ones sit below base_layer)."""
    out = {}
    for module in sorted({m for part in parts for m in part}):
        # one per expert-parallel rank (data-parallel replicas hold equal rows)
        rows = sorted({part[module][FIRST]: part[module] for part in parts if module in part}.items())
        rows = [r for _, r in rows]
        for depth, fused in enumerate(reversed([p.rsplit(".", 1)[-1] for p in ROUTED_EXPERT_PARAMETERS])):
            a, b = to_peft(*(torch.cat([r[f"lora_{kind}_{fused}"] for r in rows]) for kind in "AB"))
            prefix = module + ".base_layer" * depth
            out[f"{prefix}.lora_A.{ADAPTER}.weight"], out[f"{prefix}.lora_B.{ADAPTER}.weight"] = a, b
    return out
