"""Launch the real `deepspeed` launcher on train.py (or another script) and read what it wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def deepspeed(nproc: int, script_args: list[str], timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
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


def read_metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
