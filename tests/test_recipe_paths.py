"""A recipe copied out of the project: its relative deepspeed_config is looked up next to it first, then among the
project's shipped ds_configs/, and a name found in neither is refused naming where the shipped configs are."""

from __future__ import annotations

import os

import pytest

from deepseek_ds.config import PROJECT_ROOT, ConfigError, load_ds_config, load_run_config

SHIPPED = os.path.join(PROJECT_ROOT, "ds_configs")


def _copied_recipe(tmp_path, ds_config: str) -> str:
    recipe = tmp_path / "my-recipe.yaml"
    recipe.write_text(open(os.path.join(PROJECT_ROOT, "recipes", "tiny-v3.yaml")).read()
                      .replace("deepspeed_config: ds_configs/zero1.json", f"deepspeed_config: {ds_config}"))
    return str(recipe)


@pytest.mark.unit
def test_a_copied_recipe_finds_the_shipped_deepspeed_config(tmp_path):
    cfg = load_run_config(_copied_recipe(tmp_path, "ds_configs/zero2.json"))
    assert cfg.deepspeed_config == os.path.join(SHIPPED, "zero2.json")
    assert load_ds_config(cfg.deepspeed_config)["zero_optimization"]["stage"] == 2


@pytest.mark.unit
def test_a_config_beside_the_recipe_wins_over_the_shipped_one(tmp_path):
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "zero2.json").write_text('{"zero_optimization": {"stage": 1}}')
    cfg = load_run_config(_copied_recipe(tmp_path, "ds_configs/zero2.json"))
    assert cfg.deepspeed_config == str(tmp_path / "ds_configs" / "zero2.json")
    assert load_ds_config(cfg.deepspeed_config)["zero_optimization"]["stage"] == 1


@pytest.mark.unit
def test_a_config_found_nowhere_names_the_shipped_configs(tmp_path):
    cfg = load_run_config(_copied_recipe(tmp_path, "ds_configs/zero9.json"))
    assert cfg.deepspeed_config == str(tmp_path / "ds_configs" / "zero9.json")  # the recipe's own meaning
    with pytest.raises(ConfigError, match=rf"zero9.json' does not exist; the shipped configs are in {SHIPPED} "
                                          r"\(zero0.json, zero1.json, .*zero3_offload.json\)"):
        load_ds_config(cfg.deepspeed_config)
