"""`deepseek-ds train` and `validate`: the `deepspeed` command train hands over to, a real launch from outside the
project, and how the entry point reports errors (a user error: one line and exit 2; a bug: its traceback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deepseek_ds import cli as cli_module
from deepseek_ds.cli import TRAINING_MODULE, build_parser, train_command
from deepseek_ds.utils import system
from helpers import ROOT, cli, launch_env, read_metrics

RECIPE = os.path.join(ROOT, "recipes", "tiny-v3.yaml")


def _command(*argv: str) -> list[str]:
    return train_command(build_parser().parse_args(["train", "--config", RECIPE, *argv]))


@pytest.mark.unit
def test_train_runs_the_training_module_with_the_launcher_options():
    cmd = _command("--hostfile", os.path.join(ROOT, "hostfiles", "4node"), "-e", "node-3", "--master-port", "29611",
                   "--deepspeed-config", "ds_configs/zero2.json", "--set", "train.steps=3")
    assert os.path.basename(cmd[0]) == "deepspeed"
    module = cmd.index("--module")
    assert cmd[1:module] == ["--hostfile", os.path.join(ROOT, "hostfiles", "4node"), "--exclude", "node-3",
                             "--master_port", "29611"]
    assert cmd[module + 1:] == [TRAINING_MODULE, "--config", RECIPE, "--deepspeed_config", "ds_configs/zero2.json",
                                "--set", "train.steps=3"]
    assert _command("--num_gpus", "3")[1:3] == ["--num_gpus", "3"]


@pytest.mark.unit
def test_a_local_only_hostfile_skips_deepspeeds_ssh_check():
    """DeepSpeed runs one local host without pdsh but still ssh-es to it first; train passes what avoids that."""
    cmd = _command("--hostfile", os.path.join(ROOT, "hostfiles", "localhost"), "--include", "localhost:0,1")
    module = cmd.index("--module")
    assert cmd[1:module] == ["--hostfile", os.path.join(ROOT, "hostfiles", "localhost"), "--include", "localhost:0,1",
                             "--no_ssh_check", "--master_addr", "127.0.0.1"]
    assert "--no_ssh_check" not in _command("--hostfile", os.path.join(ROOT, "hostfiles", "4node"))


@pytest.mark.unit
def test_a_user_error_is_one_line_and_exit_2(capsys):
    assert cli(["validate", "--config", RECIPE, "--include", "node-0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["deepseek-ds: error: --include/--exclude select hosts and slots of a hostfile; give --hostfile too"]
    assert cli(["validate", "--config", RECIPE, "--hostfile", os.path.join(ROOT, "nope")]) == 2
    assert "hostfile" in capsys.readouterr().err


@pytest.mark.unit
def test_a_launch_that_cannot_start_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(system.shutil, "which", lambda *a, **k: None)
    assert cli(["train", "--config", RECIPE, "--num_gpus", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("deepseek-ds: error: the `deepspeed` launcher")


@pytest.mark.unit
def test_a_bug_keeps_its_traceback(monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("not a user error")

    monkeypatch.setattr(cli_module, "load_and_validate", bug)
    with pytest.raises(KeyError):
        cli(["validate", "--config", RECIPE])


@pytest.mark.launch
def test_train_works_from_another_directory(tmp_path, data_dir):
    out = tmp_path / "run"
    sets = [f"data.path={data_dir}", "data.seq_len=32", "train.steps=2", "train.warmup_steps=1",
            "checkpoint.interval=0", "model.overrides.num_hidden_layers=2", f"train.output_dir={out}"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-m", "deepseek_ds.cli", "train", "--config", RECIPE, "--num_gpus", "1",
                           *[a for s in sets for a in ("--set", s)]],
                          cwd=elsewhere, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(str(out))] == [1, 2]
