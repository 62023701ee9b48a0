"""The main job through the real `deepspeed` launcher on 2 ranks, and refusals before any work starts."""

import math
import os
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT, deepspeed, launch_env, read_metrics

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec"}


SHM = "/dev/shm"


def shm_buffers() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("deepspeed_allreduce_buffer_")} if os.path.isdir(SHM) else set()


@pytest.fixture(scope="module")
def demo_run(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo"))
    before = shm_buffers()
    proc = deepspeed(2, ["train.py", "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}",
                         "--set", f"data.path={data_dir}", "--set", "train.steps=40", "--set", "train.warmup_steps=5",
                         "--set", "data.seq_len=64", "--set", "checkpoint.interval=0"])
    proc.leaked_shm = shm_buffers() - before
    return out, proc


@pytest.mark.launch
def test_loss_falls_and_metrics_are_complete(demo_run):
    out, _ = demo_run
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 41))
    for r in records:
        assert KEYS <= r.keys()
        assert all(math.isfinite(r[k]) for k in KEYS)
    first = records[0]["loss"]
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert first > 7.0  # ~ln(2048) at random init: the model really starts from scratch
    assert last < first - 1.0, f"loss did not fall clearly: {first:.3f} -> {last:.3f}"


@pytest.mark.launch
def test_outputs_written(demo_run):
    out, proc = demo_run
    with open(os.path.join(out, "resolved_config.yaml")) as f:
        resolved = yaml.safe_load(f)
    assert resolved["run"]["train"]["steps"] == 40
    assert resolved["deepspeed"]["train_batch_size"] == 16
    assert resolved["deepspeed"]["gradient_accumulation_steps"] == 1  # 16 = 8 micro x 1 x 2 ranks
    assert resolved["world_size"] == 2
    with open(os.path.join(out, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.isdir(os.path.join(out, "checkpoints", "step00000040"))
    assert os.path.isfile(os.path.join(out, "logs", "rank0.log")) and os.path.isfile(os.path.join(out, "logs", "rank1.log"))
    assert "done:" in proc.stdout and "->" in proc.stdout


@pytest.mark.launch
def test_no_shared_memory_left_behind(demo_run):
    """DeepSpeed's CPU all-reduce buffers (~70 MB per rank in /dev/shm, i.e. RAM) are released at exit."""
    _, proc = demo_run
    assert not proc.leaked_shm


@pytest.mark.launch
def test_bad_config_fails_early_with_a_clear_message(tmp_path):
    proc = deepspeed(2, ["train.py", "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={tmp_path}",
                         "--set", "train.global_batch_size=10"], check=False, timeout=120)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "train.global_batch_size (10)" in text and "Traceback" not in text
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


@pytest.mark.unit
def test_cli_help_lists_subcommands():
    proc = subprocess.run([sys.executable, "-m", "deepseek_ds.cli", "--help"], capture_output=True, text=True,
                          cwd=ROOT, env=launch_env())
    assert proc.returncode == 0, proc.stderr
    for sub in ("train", "validate", "models", "data", "preflight", "bench"):
        assert sub in proc.stdout


@pytest.mark.unit
def test_cli_validate_refuses_typo():
    proc = subprocess.run([sys.executable, "-m", "deepseek_ds.cli", "validate", "--config", "recipes/tiny-v3.yaml",
                           "--set", "train.global_batch_szie=32", "--num_gpus", "2"],
                          capture_output=True, text=True, cwd=ROOT, env=launch_env())
    assert proc.returncode == 2 and "Did you mean 'global_batch_size'" in proc.stderr
