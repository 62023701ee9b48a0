"""scripts/lora_demo.sh, shortened (few items, few steps, no full run): the copy-task base pretrained, exported and
scored on the reversal task, then LoRA-trained from it, through the real commands."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from deepseek_ds.utils.net import free_port
from helpers import ROOT, launch_env, read_metrics


def _read(path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def _size(top) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(top) for f in fs)


@pytest.mark.launch
def test_lora_demo_script_connects_its_pieces(tmp_path):
    out = tmp_path / "lora-demo"
    report, sft_report = tmp_path / "report.md", _read(Path(ROOT) / "docs/bench/sft-demo.md")
    env = {**launch_env(), "LORA_DIR": str(out), "LORA_BASE_STEPS": "4", "LORA_FULL": "0", "SFT_N": "300",
           "SFT_HELDOUT": "8", "SFT_STEPS": "4", "LORA_REPORT": str(report)}
    # Its own port: a demo running at the same time holds deepspeed's default one.
    proc = subprocess.run(["bash", "scripts/lora_demo.sh", "--master_port", str(free_port())], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # The base trained on the copy task; LoRA trained on the reversal task from its export, with the recipe's
    # adapters and nothing else trainable.
    assert json.loads((out / "base" / "task" / "train.jsonl").read_text().splitlines()[0])["prompt"].startswith("copy ")
    first_lora_item = json.loads((out / "lora" / "task" / "train.jsonl").read_text().splitlines()[0])
    assert first_lora_item["prompt"].startswith("reverse ")
    resolved = yaml.safe_load((out / "lora" / "train" / "resolved_config.yaml").read_text())["run"]
    assert resolved["model"]["path"] == str(out / "base-hf") and resolved["lora"]["r"] > 0
    assert resolved["lora"]["modules_to_save"] == []
    # LoRA's "before" is the exported base's score; "after" is the one training logged at its last step.
    base, before, after = (json.loads((out / run / f"{name}.json").read_text())
                           for run, name in (("base", "after"), ("lora", "before"), ("lora", "after")))
    last = read_metrics(str(out / "lora" / "train"))[-1]
    assert last["step"] == 4 and last["task_n"] == after["n"] == 8 and last["task_exact_match"] == after["exact_match"]
    assert (f"base (copy task): held-out copy exact match {base['exact_match']:.3f}, reversal "
            f"{before['exact_match']:.3f}") in proc.stdout
    assert f"lora on reversal: exact match {before['exact_match']:.3f} -> {after['exact_match']:.3f}" in proc.stdout
    text = report.read_text()  # the printed lines, each evaluation's exact match, where it ran
    assert f"lora on reversal: exact match {before['exact_match']:.3f} -> {after['exact_match']:.3f}" in text
    assert f"| lora | 4 | {last['loss']:.3f} | {last['task_exact_match']:.3f} |" in text and "git commit" in text
    # Its SFT runs write no report of their own (the SFT demo's committed one is left as it was).
    assert _read(Path(ROOT) / "docs/bench/sft-demo.md") == sft_report
    # Adapters and their optimizer state only: a fraction of the full base run's checkpoint.
    lora_ckpt, base_ckpt = (_size(out / run / "train" / "checkpoints" / "step00000004") for run in ("lora", "base"))
    assert 0 < lora_ckpt < base_ckpt / 2, (lora_ckpt, base_ckpt)
