"""At most one host-device sync of ours per training step (issue 19): recorded_step on the real engine (one rank, an
MoE model with the load balancer's bias update and sequence-wise loss on, MTP on, two micro-batches per step) reads
to the host once, the loop's one read of every metric (tests/step_syncs_worker.py counts the reads, ours and those
of the transformers layers we call: its mask builder's packed-sequence check is skipped when the embedding made the
positions). DeepSpeed's own syncs inside engine.step() are not ours to count. The records stay whole: every metric,
and the balancer's bias moved (it is updated on the device from the summed loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepseek_ds.utils.net import free_port
from helpers import ROOT, launch_env

pytestmark = pytest.mark.launch

STEPS = 3
THE_READ = "training/metrics.py"  # read_to_host: the named metrics, read at once


def run_worker(data_dir: str, tmp_path) -> list[dict]:
    result = tmp_path / "syncs.json"
    env = {**launch_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.path.join(ROOT, "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sets = [f"data.path={data_dir}", f"train.steps={STEPS}", "eval.interval=0", "checkpoint.interval=0",
            "model.overrides.num_nextn_predict_layers=1", "train.mtp_loss_weight=0.3",
            f"train.output_dir={tmp_path / 'run'}"]
    cmd = [sys.executable, os.path.join(ROOT, "tests", "step_syncs_worker.py"), str(result),
           "--config", "recipes/tiny-v3.yaml", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(result.read_text())


def test_a_step_reads_to_the_host_once(data_dir, tmp_path):
    steps = run_worker(data_dir, tmp_path)
    assert len(steps) == STEPS and all(s["balancer"] and s["mtp_depth"] == 1 for s in steps)
    for i, s in enumerate(steps, start=1):
        assert len(s["reads"]) <= 1, f"step {i}: {s['reads']}"
        assert len(s["reads"]) == 1 and s["reads"][0].startswith(THE_READ) and "read_to_host" in s["reads"][0], s["reads"]
        assert s["stop"] == 0.0  # no signal, no failed background save
    records = [s["record"] for s in steps]
    for r in records:
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "aux_loss_seq", "grad_norm", "memory_gb",
                    "moe/layer1/load_mean", "moe/layer1/bias_std", "moe/load_ratio_max"):
            assert isinstance(r[key], float), (key, r.get(key))
        # loss = lm_loss + weight x mtp_loss; tokens x top_k spread over the experts (2 x 8 x 128, top 2 of 8).
        assert r["loss"] == pytest.approx(r["lm_loss"] + 0.3 * r["mtp_loss"], rel=1e-6)  # fp32 micro losses
        assert r["moe/layer1/load_mean"] == 16 * 128 * 2 / 8
    # gamma 1e-3 per step: after step s every bias entry is a sum of s steps of +-1e-3, so |bias| <= s e-3, and the
    # first update moves every entry.
    for s, r in enumerate(records, start=1):
        assert 0 < r["moe/layer1/bias_max"] <= s * 1e-3 + 1e-9 and r["moe/layer1/bias_min"] >= -s * 1e-3 - 1e-9
    assert records[0]["moe/layer1/bias_std"] > 0
