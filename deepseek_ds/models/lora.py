"""LoRA fine-tuning with peft, applied from outside to our pipeline layers: the family defaults of the adapted
modules, peft's own injection, a layout-independent adapter initialisation, freezing, and the combinations refused.

peft matches `target_modules` by the last components of a module's name, and below our layers' fixed attributes a
module is named as in transformers, so the same LoraConfig adapts our layers and a transformers CausalLM alike; an
adapter tensor's HF name (names.hf_name) is then also its name in a transformers model that peft injected.
"""

from __future__ import annotations

import difflib
import zlib

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn

from .layers import LMHeadPipe
from .names import hf_name
from .pipeline import layer_specs, local_layers
from .registry import FAMILIES, family_of

ADAPTER = "default"  # peft's adapter name, in every adapter tensor's name
# transformers' names of the projections LoRA adapts by default, by model_type (each family's lora_targets).
DEFAULT_TARGETS = {model_type: f.lora_targets for model_type, f in FAMILIES.items()}
# With transformers 5, peft (0.21) rewrites these target_modules of a DeepSeek model, on injection and so on every
# PeftModel.from_pretrained, into the fused routed-expert parameters (transformers 4's expert names): the dense and
# shared-expert MLPs lose them. An adapter on those MLPs would therefore not load back through peft.
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
# The fused routed-expert parameters, which peft adapts through `target_parameters` (one adapter per expert).
ROUTED_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ALL_LINEAR = "all-linear"  # peft's shorthand for every linear layer but the output head
_MODULES: dict[str, list[tuple[str, bool]]] = {}  # architecture -> (module name, adaptable linear layer)


def lora_errors(r: int, target_modules: list[str] | str | None, routed_experts: bool, expert_parallel: int,
                has_base: bool, model_type: str, moe: bool, mtp_depth: int, zero: int = 1) -> list[str]:
    """What cannot work with LoRA in a run of these settings (empty with r = 0), each with the reason and the fix
    (LoRA with tensor parallelism: models/tensor_parallel.py's rules)."""
    if r == 0:
        return []
    problems = []
    if not has_base:
        problems.append("lora.r > 0 adapts a pretrained model and its checkpoints hold only the adapters: set "
                        "model.path to the base model's HF directory (with its safetensors weights)")
    named = [] if isinstance(target_modules, str) else target_modules or ()  # all-linear leaves the MLPs out
    mlp = sorted({t.rsplit(".", 1)[-1] for t in named} & set(MLP_NAMES))
    if mlp and family_of(model_type).is_moe:
        problems.append(f"lora.target_modules {mlp} on a DeepSeek model: peft (with transformers 5) maps these names "
                        "to the fused routed experts whenever it loads an adapter, so adapters on the dense and "
                        "shared-expert MLPs would not load back; remove them (attention is the default) and set "
                        "lora.routed_experts=true to adapt the experts")
    if mtp_depth:
        # peft's suffix matching adapts the MTP modules' attention too, which the exported CausalLM (no MTP) lacks.
        problems.append(f"lora.r > 0 with {mtp_depth} MTP module(s): the adapters on them could not be exported or "
                        "evaluated (transformers' CausalLM has no MTP); set model.overrides.num_nextn_predict_layers: 0")
    if routed_experts and not moe:
        problems.append("lora.routed_experts is true but the model has no routed experts: set it to false")
    if expert_parallel > 1 and zero == 3:
        # DeepSpeed's ZeRO-3 checkpointing of AutoEP experts asserts that the expert weights train.
        problems.append("lora.r > 0 with parallel.expert_parallel > 1 and ZeRO-3: DeepSpeed cannot checkpoint frozen "
                        "AutoEP experts under ZeRO-3; use ZeRO-1 or ZeRO-2 (e.g. ds_configs/zero1.json), which shard "
                        "only the adapters' optimizer state, or parallel.expert_parallel=1")
    return problems


def model_modules(config) -> list[tuple[str, bool]]:
    """(name, is a linear layer other than the output head) of every module of the whole model, as training builds
    its pipeline layers, built once per architecture on the meta device (no memory; a plan search validates many
    layouts of one model)."""
    key = config.to_json_string()
    if key not in _MODULES:
        with torch.device("meta"):
            layers = nn.ModuleList(spec.build() for spec in layer_specs(config, seed=None))
        heads = {id(m) for layer in layers if isinstance(layer, LMHeadPipe) for m in layer.modules()}
        _MODULES[key] = [(name, isinstance(m, nn.Linear) and id(m) not in heads) for name, m in layers.named_modules()]
    return _MODULES[key]


def _all_linear(config) -> list[str]:
    """peft's `all-linear` on this model: the last name of every linear layer but the output head; on DeepSeek
    models without the MLP names, which peft would map to the fused routed experts (MLP_NAMES)."""
    names = {name.rsplit(".", 1)[-1] for name, linear in model_modules(config) if linear}
    if family_of(config).is_moe:
        names -= set(MLP_NAMES)
    return sorted(names)


def target_modules(section, config) -> list[str]:
    """lora.target_modules (`all-linear` expanded to names), or the model family's default (null)."""
    if section.target_modules == ALL_LINEAR:
        return _all_linear(config)
    return list(section.target_modules) if section.target_modules is not None else \
        list(DEFAULT_TARGETS[config.model_type])


def lora_name_errors(section, config) -> list[str]:
    """Every lora.target_modules and lora.modules_to_save name that matches no module of the model, with the nearest
    module names: peft adapts any module whose name ends with a target (a typo beside a matching name is silently
    ignored, and no match at all is its NoMatchingPeftModuleError); a modules_to_save name must be a module's own
    name, as mark_trainable unfreezes it."""
    if not section.r:
        return []
    names = [name for name, _ in model_modules(config)]
    # Suggestions: the last one or two components of the module names, without the layer indices.
    suffixes = sorted({".".join(parts[-k:]) for parts in (n.split(".") for n in names) for k in (1, 2)
                       if len(parts) >= k and not any(p.isdigit() for p in parts[-k:])})
    last = {n.rsplit(".", 1)[-1] for n in names}

    def unmatched(field: str, wanted: list[str], matches) -> list[str]:
        out = []
        for w in wanted:
            if not matches(w):
                near = difflib.get_close_matches(w, suffixes, n=3, cutoff=0.6)
                out.append(f"lora.{field} {w!r} matches no module of the model"
                           + (f" (nearest: {', '.join(near)})" if near else "") + "; correct or remove it")
        return out

    targets = [] if section.target_modules in (None, ALL_LINEAR) else list(section.target_modules)
    errors = unmatched("target_modules", targets, lambda t: any(n == t or n.endswith("." + t) for n in names))
    if targets and len(errors) == len(targets):
        errors = [f"lora.target_modules {targets} match no module of the model, so no adapter would be injected; "
                  f"name some of its linear layers ({', '.join(_all_linear(config))}), use all-linear, or null for the "
                  "family's default"]
    return errors + unmatched("modules_to_save", list(section.modules_to_save), lambda m: m in last)


def lora_config(section, config, modules_to_save: bool = False, routers: tuple[str, ...] = ()) -> LoraConfig:
    """peft's LoraConfig of the run's `lora` section. In training, modules_to_save are unfrozen in place
    (mark_trainable); peft's own copies of them (modules_to_save=True) are for a PeftModel, as export writes, which
    adds the `routers` (module names) whose bias buffers training moved: a copy carries its buffers."""
    saved = [*section.modules_to_save, *routers] if modules_to_save else []
    return LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=target_modules(section, config),
                      target_parameters=list(ROUTED_EXPERT_PARAMETERS) if section.routed_experts else None,
                      modules_to_save=saved or None)


def apply_lora(model: nn.Module, section, config, seed: int) -> int:
    """Inject peft adapters into this rank's layers (after their base weights are loaded), initialise them, freeze
    everything else but lora.modules_to_save; returns the number of trainable parameters of this rank."""
    inject_adapter_in_model(lora_config(section, config), model, adapter_name=ADAPTER)
    init_adapters_(model, seed)
    mark_trainable(model, section.modules_to_save)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def init_adapters_(model: nn.Module, seed: int) -> None:
    """peft's initialisation of every adapter (A as nn.Linear's default, B = 0) drawn from a seed of its own, from
    the run's seed and the module's HF name: the same initial adapters whatever the pipeline layout or rank."""
    for layer in local_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, LoraLayer):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(zlib.crc32(f"{seed}:{hf_name(layer, name + '.')}".encode()))
                    module.reset_lora_parameters(ADAPTER, True)


def mark_trainable(model: nn.Module, modules_to_save) -> None:
    """The modules named in modules_to_save (by their last name component) train in full; peft's injection has
    already frozen everything but the adapters."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in modules_to_save:
            module.requires_grad_(True)
