"""Credentials stay out of the files a run writes: redacted in resolved_config.yaml and checkpoint.json, absent
from the logs; the launch wrappers' .deepspeed_env is owner-only and removed when the launcher exits."""

import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from deepseek_ds.checkpoint import model_fingerprint
from deepseek_ds.config import load_ds_config, resolve_ds_config, run_config_from_dict, write_resolved
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.utils.redact import REDACTED, is_secret_key, redact
from helpers import train

ROOT = Path(__file__).resolve().parents[1]
ZERO1 = ROOT / "ds_configs" / "zero1.json"
COMET_KEY = "comet-secret-4f1d9a"
ENV_SECRETS = {"WANDB_API_KEY": "wandb-secret-77c2", "HF_TOKEN": "hf_secret_91ab", "AWS_SECRET_ACCESS_KEY": "aws-3e8f"}


@pytest.mark.unit
@pytest.mark.parametrize("name", ["api_key", "apiKey", "WANDB_API_KEY", "HF_TOKEN", "token", "AWS_SECRET_ACCESS_KEY",
                                  "client_secret", "password", "db-password", "experiment_key"])
def test_credential_like_keys(name):
    assert is_secret_key(name)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["reduce_bucket_size", "tokenizer_hash", "max_tokens", "keep", "keep_in_fp32_modules",
                                  "sort_keys", "monkey", "stage3_prefetch_bucket_size", "vocab_size", "lr",
                                  "bos_token_id", "pad_token_id", "num_key_value_heads", "key_value_heads"])
def test_ordinary_keys(name):
    assert not is_secret_key(name)


@pytest.mark.unit
def test_redact_replaces_secret_values_at_any_depth_and_leaves_the_input_alone():
    doc = {"comet": {"enabled": True, "api_key": COMET_KEY, "project": "p"},
           "runs": [{"token": "t0", "steps": 3}], "password": None, "zero_optimization": {"reduce_bucket_size": 5}}
    out = redact(doc)
    assert out == {"comet": {"enabled": True, "api_key": REDACTED, "project": "p"},
                   "runs": [{"token": REDACTED, "steps": 3}], "password": None,
                   "zero_optimization": {"reduce_bucket_size": 5}}
    assert doc["comet"]["api_key"] == COMET_KEY


@pytest.mark.unit
def test_a_model_config_comes_through_unredacted():
    """A resume compares the saved model config with the run's: its token ids and head counts must survive."""
    fingerprint = model_fingerprint(build_model_config("tiny-v3"))
    assert redact(fingerprint) == fingerprint and "bos_token_id" in fingerprint


def _ds_with_comet_key() -> dict:
    ds = load_ds_config(str(ZERO1))
    ds["comet"] = {"enabled": False, "api_key": COMET_KEY, "project": "deepseek-ds"}  # comet_ml is not installed
    return ds


@pytest.mark.unit
def test_resolved_config_has_no_secret(tmp_path):
    cfg = run_config_from_dict({"train": {"output_dir": str(tmp_path)}, "deepspeed_config": str(ZERO1)})
    path = write_resolved(cfg, resolve_ds_config(_ds_with_comet_key(), cfg, 1), 1)
    text = Path(path).read_text()
    assert COMET_KEY not in text
    doc = yaml.safe_load(text)
    assert doc["deepspeed"]["comet"] == {"enabled": False, "api_key": REDACTED, "project": "deepseek-ds"}
    assert doc["deepspeed"]["zero_optimization"]["stage"] == 1


def _fake_launch(tmp_path, umask: int) -> subprocess.CompletedProcess:
    (tmp_path / "secret.env").write_text("WANDB_API_KEY=wandb-secret-77c2\n")
    (tmp_path / ".deepspeed_env").write_text("OLD=1\n")
    (tmp_path / ".deepspeed_env").chmod(0o644)  # a file left by an older launch, world-readable
    fake = tmp_path / "deepspeed"  # what the launcher would see: the file's mode and content
    fake.write_text("#!/bin/bash\nstat -c 'mode=%a' .deepspeed_env\ngrep -c WANDB_API_KEY .deepspeed_env\nexit 3\n")
    fake.chmod(0o755)
    script = f"umask {umask:03o}; exec bash {ROOT / 'launch' / 'pdsh.sh'} -H {ROOT / 'hostfiles' / '4node'} " \
             f"-c r.yaml --env {tmp_path / 'secret.env'}"
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DEEPSPEED": str(fake)})


@pytest.mark.unit
@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_wrapper_env_file_is_owner_only_and_removed_after_the_launch(tmp_path, umask):
    out = _fake_launch(tmp_path, umask)
    assert out.returncode == 3, out.stderr  # the launcher's exit status is the wrapper's
    assert out.stdout.split() == ["mode=600", "1"]
    assert not (tmp_path / ".deepspeed_env").exists()


@pytest.mark.unit
def test_wrapper_passes_term_to_the_launcher_and_still_removes_the_env_file(tmp_path):
    fake = tmp_path / "deepspeed"
    fake.write_text("#!/bin/bash\nsleep 30 >/dev/null 2>&1 &\ntrap 'kill $!; echo got-term; exit 7' TERM\n"
                    "echo started\nwait\n")
    fake.chmod(0o755)
    (tmp_path / "a.env").write_text("A=1\n")
    proc = subprocess.Popen(["bash", str(ROOT / "launch" / "pdsh.sh"), "-H", str(ROOT / "hostfiles" / "4node"),
                             "-c", "r.yaml", "--env", str(tmp_path / "a.env")], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "DEEPSPEED": str(fake)})
    assert proc.stdout.readline().strip() == "started"
    assert stat.S_IMODE((tmp_path / ".deepspeed_env").stat().st_mode) == 0o600
    proc.terminate()
    stdout, _ = proc.communicate(timeout=20)
    assert proc.returncode == 7 and "got-term" in stdout
    assert not (tmp_path / ".deepspeed_env").exists()


@pytest.mark.launch
def test_no_secret_under_the_run_directory(data_dir, tmp_path, monkeypatch):
    """2 ranks, 2 steps, a checkpoint: a comet key in the DeepSpeed JSON and credentials in the environment appear
    in no file of the run (resolved_config.yaml, checkpoint.json, logs, metrics)."""
    import json

    for k, v in ENV_SECRETS.items():
        monkeypatch.setenv(k, v)
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps(_ds_with_comet_key()))
    out = tmp_path / "run"
    train(2, str(out), [f"data.path={data_dir}", "train.steps=2", "checkpoint.interval=1", "eval.interval=0",
                        "data.seq_len=32", "model.overrides.num_hidden_layers=2"], ds_config=str(ds_path))
    metas = sorted((out / "checkpoints").glob("step*/checkpoint.json"))
    assert len(metas) == 2
    meta = json.loads(metas[-1].read_text())
    assert meta["deepspeed_config"]["comet"]["api_key"] == REDACTED
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "rank0.log" for p in files)
    for secret in [COMET_KEY, *ENV_SECRETS.values()]:
        leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert not leaked, f"{secret} in {leaked}"
