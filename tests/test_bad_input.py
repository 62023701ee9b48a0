"""Bad input refused by validate() (so by `deepseek-ds validate` and by every rank of train.py before distributed
init), one line each naming the key and the fix: DeepSpeed JSON and model-override typos, a dataset or sequence
length the model cannot take, pickle-only model weights; and a DeepSpeed JSON without an optimizer, filled in."""

import json
import os

import pytest
import yaml

from deepseek_ds.config import (
    RESOLVED_NAME,
    load_ds_config,
    resolve_ds_config,
    run_config_from_dict,
    validate,
    write_resolved,
)
from deepseek_ds.config.deepspeed_json import deepspeed_top_level_keys
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.training.main import main as train_main
from helpers import cli, refused

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZERO1 = os.path.join(ROOT, "ds_configs", "zero1.json")


def write_json(path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def test_misspelt_top_level_deepspeed_key_is_refused_with_its_spelling():
    ds = load_ds_config(ZERO1)
    ds["zero_optimisation"] = ds.pop("zero_optimization")
    message = refused(run_config_from_dict({}), ds)
    assert "unknown top-level key 'zero_optimisation'" in message
    assert "did you mean 'zero_optimization'?" in message


def test_top_level_keys_come_from_deepspeed_and_cover_its_sections():
    keys = deepspeed_top_level_keys()
    for section in ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16", "pipeline", "wandb", "comet",
                    "tensorboard", "csv_monitor", "activation_checkpointing", "flops_profiler", "gradient_clipping",
                    "train_micro_batch_size_per_gpu", "checkpoint", "aio"):
        assert section in keys, section
    assert "zero_optimisation" not in keys and "stage" not in keys


def test_deepspeed_typo_refused_by_the_cli_and_by_train_py_before_init(tmp_path, monkeypatch, capsys):
    ds = load_ds_config(ZERO1)
    ds["gradient_clipings"] = 1.0
    path = write_json(tmp_path / "typo.json", ds)
    args = ["--config", "recipes/tiny-v3.yaml", "--deepspeed_config", path, "--set", f"train.output_dir={tmp_path}"]
    assert cli(["validate", *args]) == 2
    assert "did you mean 'gradient_clipping'?" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # no process group is ever created: the refusal comes first
    assert train_main(args) == 2
    assert "gradient_clipings" in capsys.readouterr().err
    assert not (tmp_path / RESOLVED_NAME).exists()


@pytest.mark.parametrize("preset,key,nearest", [("tiny-v3", "num_hidden_layer", "num_hidden_layers"),
                                                ("tiny-dense", "intermediate_sise", "intermediate_size"),
                                                ("tiny-v2", "n_routed_expert", "n_routed_experts")])
def test_misspelt_model_override_is_refused_with_the_nearest_field(preset, key, nearest):
    cfg = run_config_from_dict({"model": {"preset": preset, "overrides": {key: 2}}})
    message = refused(cfg, load_ds_config(ZERO1))
    assert f"model.overrides.{key} is not a field of" in message
    assert f"did you mean '{nearest}'?" in message


def test_real_model_overrides_and_aliases_pass():
    for overrides in ({"num_hidden_layers": 2, "attention_dropout": 0.1}, {"num_local_experts": 4}):
        mcfg = build_model_config("tiny-v3", overrides=overrides)
    assert mcfg.n_routed_experts == 4  # the alias reached the field it names


def test_seq_len_above_max_position_embeddings_is_refused_with_the_fix(tmp_path):
    cfg = run_config_from_dict({"data": {"seq_len": 2048}})  # tiny-v3: 1024 positions
    message = refused(cfg, load_ds_config(ZERO1))
    assert ("data.seq_len (2048) exceeds the model's max_position_embeddings (1024): lower data.seq_len, or --set "
            "model.overrides.max_position_embeddings=N") in message
    # The fix it names passes.
    fixed = run_config_from_dict({"data": {"seq_len": 2048}, "model": {"overrides": {"max_position_embeddings": 2048}}})
    validate(fixed, load_ds_config(ZERO1), 1, cuda_available=False)
    # A checkpoint's positions were trained for its length: the fix is RoPE scaling, not only a larger limit.
    build_model_config("tiny-v3").save_pretrained(tmp_path)
    cfg = run_config_from_dict({"data": {"seq_len": 2048}, "model": {"preset": None, "path": str(tmp_path)}})
    message = refused(cfg, load_ds_config(ZERO1))
    assert "lower data.seq_len, or extend the checkpoint's context with RoPE scaling" in message


def test_dataset_with_a_larger_vocabulary_than_the_model_is_refused(data_dir):
    cfg = run_config_from_dict({"data": {"path": data_dir, "seq_len": 32},
                                "model": {"overrides": {"vocab_size": 1000}}})
    message = refused(cfg, load_ds_config(ZERO1))
    assert f"data.path {data_dir!r} was tokenized with 2048 tokens but the model's vocab_size is 1000" in message
    ok = run_config_from_dict({"data": {"path": data_dir, "seq_len": 32}})
    validate(ok, load_ds_config(ZERO1), 1, cuda_available=False)


def test_deepspeed_json_without_optimizer_gets_adamw_from_the_run_config(tmp_path):
    ds = {k: v for k, v in load_ds_config(ZERO1).items() if k != "optimizer"}
    cfg = run_config_from_dict({"train": {"lr": 3e-4, "beta1": 0.8, "beta2": 0.9, "eps": 1e-7, "weight_decay": 0.05,
                                          "output_dir": str(tmp_path)},
                                "deepspeed_config": write_json(tmp_path / "no_opt.json", ds)})
    validate(cfg, ds, 1, cuda_available=False)
    resolved = resolve_ds_config(ds, cfg, 1)
    assert resolved["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-7,
                                                                 "weight_decay": 0.05}}
    assert "optimizer" not in ds  # the user's JSON is left as it was
    doc = yaml.safe_load(open(write_resolved(cfg, resolved, 1)))
    assert doc["deepspeed"]["optimizer"]["type"] == "AdamW"
    assert any("no 'optimizer' section" in line for line in doc["filled_in"])


def test_validate_says_the_optimizer_was_filled_in(tmp_path, capsys):
    ds = {k: v for k, v in load_ds_config(ZERO1).items() if k != "optimizer"}
    path = write_json(tmp_path / "no_opt.json", ds)
    assert cli(["validate", "--config", "recipes/tiny-v3.yaml", "--deepspeed_config", path,
                "--set", f"train.output_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "note: deepspeed_config has no 'optimizer' section: using AdamW" in out


def test_json_with_its_own_optimizer_is_not_noted(tmp_path):
    cfg = run_config_from_dict({"train": {"output_dir": str(tmp_path)}, "deepspeed_config": ZERO1})
    doc = yaml.safe_load(open(write_resolved(cfg, resolve_ds_config(load_ds_config(ZERO1), cfg, 1), 1)))
    assert doc["filled_in"] == []


def test_model_path_with_only_pickle_weights_is_refused(tmp_path):
    build_model_config("tiny-v3").to_json_file(str(tmp_path / "config.json"))
    cfg = run_config_from_dict({"model": {"path": str(tmp_path), "preset": None}})
    validate(cfg, load_ds_config(ZERO1), 1, cuda_available=False)  # config only: a fresh model, as documented
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    message = refused(cfg, load_ds_config(ZERO1))
    assert "holds only PyTorch pickle weights (pytorch_model.bin)" in message
    assert "save_pretrained(DIR, safe_serialization=True)" in message
    (tmp_path / "model.safetensors").write_bytes(b"")  # safetensors next to it: those are what is read
    validate(cfg, load_ds_config(ZERO1), 1, cuda_available=False)
