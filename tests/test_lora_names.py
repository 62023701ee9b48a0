"""Every name in lora.target_modules and lora.modules_to_save must match a module of the model (peft's suffix rule
for targets; the module's own name for modules_to_save, as training unfreezes them): a misspelt name is refused with
the nearest module names, never ignored beside one that matches, and no target matching anything is one line, not
peft's traceback. `all-linear` is peft's shorthand, checked against peft's own expansion on the transformers model.
The LoRA guide's list of each family's default targets is models/lora.py's, as an exported adapter_config.json has it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import _maybe_include_all_linear_layers
from transformers import AutoModelForCausalLM

from deepseek_ds.config import ConfigError, load_ds_config, load_run_config, validate
from deepseek_ds.models.lora import DEFAULT_TARGETS, MLP_NAMES, apply_lora, lora_config, target_modules
from deepseek_ds.models.pipeline import build_model, prepare_config
from deepseek_ds.models.presets import build_model_config
from helpers import cli

LORA = ["lora.r=2", "lora.alpha=4"]
ROOT = Path(__file__).resolve().parents[1]


def _refused(sets: list[str], recipe: str = "recipes/tiny-v3.yaml") -> str:
    """validate()'s refusal of a LoRA run of `recipe` (files=False: no base directory is needed for names)."""
    cfg = load_run_config(recipe, [*LORA, *sets])
    with pytest.raises(ConfigError) as e:
        validate(cfg, load_ds_config("ds_configs/zero1.json"), 2, cuda_available=False, files=False)
    return str(e.value)


@pytest.mark.unit
def test_a_misspelt_name_beside_a_matching_one_is_refused_with_the_nearest_names():
    message = _refused(["lora.target_modules=[o_proj, kv_b_projj]", "lora.modules_to_save=[lm_heads]"])
    assert "lora.target_modules 'kv_b_projj' matches no module of the model (nearest: kv_b_proj" in message
    assert "lora.modules_to_save 'lm_heads' matches no module of the model (nearest: lm_head" in message
    assert "'o_proj'" not in message  # the name that matches is not blamed
    # The same names spelt right pass (a dotted suffix too, as peft matches it).
    cfg = load_run_config("recipes/tiny-v3.yaml", [*LORA, "lora.target_modules=[o_proj, self_attn.kv_b_proj]",
                                                   "lora.modules_to_save=[lm_head]"])
    validate(cfg, load_ds_config("ds_configs/zero1.json"), 2, cuda_available=False, files=False)


@pytest.mark.unit
@pytest.mark.parametrize("experts", ["false", "true"])
def test_no_target_matching_any_module_is_one_line_not_peft_s_traceback(experts, capsys):
    message = _refused(["lora.target_modules=[attention]", f"lora.routed_experts={experts}"])
    assert "lora.target_modules ['attention'] match no module of the model, so no adapter would be injected" in message
    # `plan` built the adapted model with peft and died with NoMatchingPeftModuleError: now the one-line refusal.
    status = cli(["plan", "--config", "recipes/tiny-v3.yaml", "--gpu-memory", "80GB", "--num_gpus", "2",
                  "--set", "lora.r=2", "--set", "lora.target_modules=[attention]",
                  "--set", f"lora.routed_experts={experts}"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("deepseek-ds: error: ") and "match no module of the model" in err
    assert "Traceback" not in err and "NoMatchingPeftModuleError" not in err


def _peft_all_linear(preset: str) -> set[str]:
    """peft's own expansion of 'all-linear' on the transformers CausalLM of `preset` (meta device): the last name
    components of every linear module but the output head."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_model_config(preset))
    expanded = _maybe_include_all_linear_layers(LoraConfig(target_modules="all-linear"), model).target_modules
    return {name.rsplit(".", 1)[-1] for name in expanded}


@pytest.mark.unit
def test_all_linear_means_what_peft_means():
    dense = load_run_config("recipes/tiny-dense.yaml", [*LORA, "lora.target_modules=all-linear"])
    mcfg = prepare_config(build_model_config("tiny-dense"))
    peft_names = _peft_all_linear("tiny-dense")
    assert "lm_head" not in peft_names and len(peft_names) == 7
    assert set(target_modules(dense.lora, mcfg)) == peft_names
    # The adapters our model gets are on the same modules peft adapts in the transformers model.
    model = build_model(mcfg, 1, 0)
    apply_lora(model, dense.lora, mcfg, seed=0)
    adapted = {n.rsplit(".", 3)[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == peft_names
    validate(dense, load_ds_config("ds_configs/zero1.json"), 2, cuda_available=False, files=False)
    # DeepSeek: peft's set less the MLP names, which peft would map to the fused routed experts (MLP_NAMES).
    v3 = load_run_config("recipes/tiny-v3.yaml", [*LORA, "lora.target_modules=all-linear"])
    mcfg = prepare_config(build_model_config("tiny-v3"))
    assert set(target_modules(v3.lora, mcfg)) == _peft_all_linear("tiny-v3") - set(MLP_NAMES)
    validate(v3, load_ds_config("ds_configs/zero1.json"), 2, cuda_available=False, files=False)


@pytest.mark.unit
def test_a_string_other_than_all_linear_is_refused():
    with pytest.raises(ConfigError, match=r"lora.target_modules = 'o_proj': a list of module names"):
        load_run_config("recipes/tiny-v3.yaml", [*LORA, "lora.target_modules=o_proj"])


# The guide's list of each family's default targets: "`type` and `type` (what): `name`, `name`, ...;" up to the
# first "." or ";".
_DOCUMENTED = re.compile(r"((?:`\w+`(?: and |, )?)+) \([^)]*\): ((?:`[\w.]+`(?:, )?)+)[.;]")


def documented_default_targets(text: str) -> dict[str, tuple[str, ...]]:
    """model_type -> default target_modules, as docs/guides/lora.md states them."""
    start = text.index("on the family's default modules")
    out = {}
    span = " ".join(text[start:text.index("lora.routed_experts: true", start)].split())  # lines joined
    for types, names in _DOCUMENTED.findall(span):
        for model_type in re.findall(r"`(\w+)`", types):
            out[model_type] = tuple(re.findall(r"`([\w.]+)`", names))
    return out


@pytest.mark.unit
def test_the_guide_lists_each_family_s_default_targets_as_lora_py_and_the_adapter_config_have_them():
    documented = documented_default_targets((ROOT / "docs" / "guides" / "lora.md").read_text())
    assert documented == DEFAULT_TARGETS, "docs/guides/lora.md's default target_modules differ from models/lora.py"
    # What an exported adapter_config.json lists (peft writes lora_config's target_modules), for the recipe's null.
    cfg = load_run_config("recipes/lora-tiny-v3.yaml", ["model.path=null", "model.preset=tiny-v3"])
    assert cfg.lora.target_modules is None
    written = lora_config(cfg.lora, prepare_config(build_model_config("tiny-v3")), modules_to_save=True)
    assert sorted(written.target_modules) == sorted(documented["deepseek_v3"])
