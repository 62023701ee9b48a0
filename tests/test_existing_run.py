"""A run pointed at an output directory that already holds checkpoints: `deepseek-ds validate` (and every rank,
before building its engine) says whether it resumes, or refuses a checkpoint of another model or tokenizer with
the fix (another train.output_dir)."""

import json
import os

import pytest

from deepseek_ds.checkpoint import FORMAT_VERSION, META, model_fingerprint
from deepseek_ds.data import dataset_info
from deepseek_ds.models.pipeline import prepare_config
from deepseek_ds.models.presets import build_model_config
from helpers import cli

pytestmark = pytest.mark.unit


def _fake_checkpoint(out: str, preset: str, tokenizer_hash: str) -> str:
    tag_dir = os.path.join(out, "checkpoints", "step00000004")
    os.makedirs(tag_dir)
    meta = {"format_version": FORMAT_VERSION, "step": 4, "tokenizer_hash": tokenizer_hash,
            "model_config": model_fingerprint(prepare_config(build_model_config(preset))), "dataset_dir": "elsewhere",
            "run_config": {"lora": {"r": 0}}}  # a full fine-tuning run's
    with open(os.path.join(tag_dir, META), "w") as f:
        json.dump(meta, f)
    return tag_dir


def _validate(out: str, data_dir: str) -> int:
    return cli(["validate", "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}",
                "--set", f"data.path={data_dir}"])


def test_validate_says_a_new_run_or_the_checkpoint_it_resumes(tmp_path, data_dir, capsys):
    out = str(tmp_path / "run")
    assert _validate(out, data_dir) == 0
    assert f"a new run in {out}" in capsys.readouterr().out
    tag_dir = _fake_checkpoint(out, "tiny-v3", dataset_info(data_dir)["tokenizer_hash"])
    assert _validate(out, data_dir) == 0
    assert f"resumes from {tag_dir}" in capsys.readouterr().out


def test_checkpoint_of_another_tokenizer_or_model_is_refused_before_launch(tmp_path, data_dir, capsys):
    out = str(tmp_path / "run")
    _fake_checkpoint(out, "tiny-v3", "0" * 64)
    assert _validate(out, data_dir) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepseek-ds: error: checkpoint ") and "tokenizer hash: checkpoint 000000000000" in err
    assert "choose another train.output_dir" in err and "Traceback" not in err
    other = str(tmp_path / "dense")
    _fake_checkpoint(other, "tiny-dense", dataset_info(data_dir)["tokenizer_hash"])
    assert _validate(other, data_dir) == 2
    assert "model config model_type: checkpoint 'llama', this run 'deepseek_v3'" in capsys.readouterr().err
