"""What the tests share: launching the real `deepspeed` launcher (on train.py or another script) and reading what
it wrote, the `deepseek-ds` command line in-process, checkpoint-directory copies, and the loss of a training step's
global batch recomputed in one process. Tests import this module, never each other."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepseek_ds.config import ConfigError, validate
from deepseek_ds.utils.net import free_port
from reference_data import StreamSamples, step_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
IGNORE_INDEX = -100  # the label transformers' and our losses skip


# ----------------------------------------------------------------------------------------------- launching
def launch_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def deepspeed(nproc: int, script_args: list[str], timeout: int = 600,
              check: bool = True) -> subprocess.CompletedProcess:
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port())] + script_args
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def train(nproc: int, output_dir: str, sets: list[str], ds_config: str | None = None,
          config: str = "recipes/tiny-v3.yaml", timeout: int = 600) -> list[dict]:
    """Run train.py under the launcher; returns the records of metrics.jsonl."""
    args = ["train.py", "--config", config, "--set", f"train.output_dir={output_dir}"]
    if ds_config:
        args += ["--deepspeed_config", ds_config]
    for s in sets:
        args += ["--set", s]
    deepspeed(nproc, args, timeout=timeout)
    return read_metrics(output_dir)


def train_layouts(nproc: int, root: Path, layouts: list, sets: list[str], worker: str = "tests/layouts_worker.py",
                  config: str = "recipes/tiny-v3.yaml", timeout: int = 900) -> dict[str, Path]:
    """Every layout (name, deepspeed config, extra --set values) trained in ONE launch of `worker` (layouts_worker.py
    or one built on it), one after the other: one start-up instead of one per layout. Returns each layout's
    train.output_dir (root / name)."""
    spec = [[ds_config, extra + [f"train.output_dir={root / name}"]] for name, ds_config, extra in layouts]
    args = [worker, "--config", config, "--layouts", json.dumps(spec)]
    for s in sets:
        args += ["--set", s]
    deepspeed(nproc, args, timeout=timeout)
    return {name: root / name for name, _, _ in layouts}


def read_metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


def router_biases(records: list[dict]) -> dict[int, dict]:
    """Per step, the router-bias statistics the training loop logs (after that step's bias update)."""
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("moe/") and "/bias_" in k} for r in records}


# ----------------------------------------------------------------------------------------------- checkpoints
def checkpoint_sets(data_dir: str, steps: int, interval: int, *extra: str) -> list[str]:
    """The --set overrides of the checkpointing runs (conftest.py's, and their resumes)."""
    return [f"data.path={data_dir}", f"train.steps={steps}", f"checkpoint.interval={interval}", "eval.interval=0",
            *extra]


# The runs resumed again and again (test_resume_chain.py's chain, test_checkpoint_kills.py's killed relaunches) and
# their one straight reference (conftest.py `straight`): attention dropout on (the tiny presets have none), so every
# resume must also have restored each rank's torch RNG to repeat the straight run bit for bit.
DROPOUT = "model.overrides.attention_dropout=0.1"
STRAIGHT_STEPS = 14


def resuming_sets(data_dir: str, steps: int, interval: int) -> list[str]:
    return checkpoint_sets(data_dir, steps, interval, "data.seq_len=32", "checkpoint.keep=2", DROPOUT)


def snapshot(ckpt_dir: Path, tag: str, dest: Path) -> Path:
    """A copy of one step directory, so later runs writing into `ckpt_dir` do not change it."""
    shutil.copytree(ckpt_dir / tag, dest / tag)
    return dest / tag


def fresh_ckpt_dir(step_dir: Path, dest: Path) -> Path:
    """A checkpoint.dir holding only `step_dir`: what a resuming run gets to write into."""
    shutil.copytree(step_dir, dest / step_dir.name)
    return dest


# ----------------------------------------------------------------------------------------------- in-process
def cli(argv: list[str]) -> int:
    """`deepseek-ds ARGV` in this process, through the real entry point."""
    from deepseek_ds.cli import main  # every sub-command's module: imported by the tests that run the CLI only

    return main(argv)


def mask_prompt(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Labels with a prompt-like prefix masked (-100), as supervised fine-tuning data has: sample i loses its first
    input_ids[i, 0] % (T / 2) labels, so micro-batches and ranks hold different numbers of valid tokens. A function
    of each sample's own tokens: the same whichever rank or micro-batch the sample lands in."""
    out = labels.clone()
    half = labels.shape[1] // 2
    for i, first in enumerate(input_ids[:, 0].tolist()):
        out[i, :first % half] = IGNORE_INDEX
    return out


def training_loss(model, data_dir: str, step: int, seq_len: int = 128, global_batch: int = 16,
                  micro_batch: int = 8, seed: int = 1234) -> float:
    """The token-weighted (main-model) loss of the global batch that training step `step` used (training's
    TokenWeightedLoss), for a run of the given shape and train.seed (defaults: recipes/tiny-v3.yaml), in the
    references' own data order (reference_data.py)."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for input_ids, labels in step_batch(StreamSamples(data_dir, seq_len), step, global_batch, seed,
                                            micro_batch=micro_batch):
            logits = model(input_ids=input_ids).logits
            total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


def refused(cfg, ds: dict, world: int = 1, match: str | None = None, cuda: bool = False) -> str:
    """validate() must refuse (with a message matching `match`, when given); returns that message."""
    with pytest.raises(ConfigError, match=match) as e:
        validate(cfg, ds, world, cuda_available=cuda)
    return str(e.value)
