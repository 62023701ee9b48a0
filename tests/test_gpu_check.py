"""scripts/gpu_check.sh: its CPU smoke mode end to end (what CI runs), the full GPU plan checked without a GPU
(every variant passes validate() and has the sizes it claims), and its refusal to run the full check on a CPU."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from transformers import DeepseekV2ForCausalLM, LlamaForCausalLM

from deepseek_ds.bench import gpu_check
from deepseek_ds.config import load_and_validate
from deepseek_ds.models.presets import build_model_config
from helpers import ROOT, launch_env, training_loss
from reference import reference_model


def meta_params(model_cls, cfg) -> int:
    with torch.device("meta"):
        model = model_cls(build_model_config(cfg.model.preset, None, cfg.model.overrides))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.unit
def test_full_plan_is_valid_and_sized_as_described(data_dir, tmp_path):
    p = gpu_check.plan(smoke=False, cuda=True, data_dir=data_dir, work_dir=str(tmp_path))
    assert [(v.section, v.option) for v in p.variants] == [
        ("precision", "fp32"), ("precision", "bf16"), ("precision", "fp16"),
        ("speed", "compile off"), ("speed", "compile on"), ("speed", "experts grouped_mm"), ("speed", "experts eager")]
    assert p.not_run == []
    configs = {}
    for v in p.variants:  # what the GPU machine will run passes the same validate() every rank runs
        sets = [*v.sets, f"train.output_dir={tmp_path / 'out'}", f"train.global_batch_size={v.global_batch}"]
        cfg, ds = load_and_validate(gpu_check.ROOT / gpu_check.RECIPE, v.ds_config, sets, 1, cuda_available=True)
        configs[(v.section, v.option)] = (cfg, ds)
    assert configs[("precision", "fp16")][1]["fp16"]["initial_scale_power"] == gpu_check.FP16_INITIAL_SCALE_POWER
    assert configs[("speed", "compile on")][0].train.compile and not configs[("speed", "compile off")][0].train.compile
    dense, _ = configs[("speed", "compile off")]
    assert dense.data.seq_len == 2048 and "bf16" in configs[("speed", "compile off")][1]
    # ~1B dense: embeddings + head, 16 x (attention 4h^2 + MLP 3hi + 2 norms), final norm.
    h, i, vocab = 2048, 5632, 32256
    assert meta_params(LlamaForCausalLM, dense) == 2 * vocab * h + 16 * (4 * h * h + 3 * h * i + 2 * h) + h
    moe, _ = configs[("speed", "experts eager")]
    assert moe.model.experts_implementation == "eager"
    mcfg = build_model_config(moe.model.preset, None, moe.model.overrides)
    assert (mcfg.num_hidden_layers, mcfg.n_routed_experts, mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim,
            mcfg.v_head_dim) == (4, 64, 192, 128)
    assert 1e9 < meta_params(DeepseekV2ForCausalLM, moe) < 4e9  # fits one GPU with Adam in bf16 ZeRO-1


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_full_check_on_a_cpu_is_refused(tmp_path, capsys):
    assert gpu_check.main(["--work-dir", str(tmp_path)]) == 2
    assert "deepseek-ds: error: no CUDA device is visible" in capsys.readouterr().err


@pytest.mark.launch
def test_smoke_mode_runs_the_check_on_the_cpu(data_dir, tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--smoke", "--data", data_dir, "--work-dir", str(tmp_path)],
                          cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {(r["section"], r["model"], r["option"]): r for r in result["rows"]}
    assert list(rows) == [("precision", "tiny-v3", "fp32"), ("precision", "tiny-v3", "bf16"),
                          ("speed", "tiny-dense", "compile off"), ("speed", "tiny-v2", "experts grouped_mm"),
                          ("speed", "tiny-v2", "experts eager")]
    fp32, bf16 = rows[("precision", "tiny-v3", "fp32")], rows[("precision", "tiny-v3", "bf16")]
    # Step 1 (before any update) against the one-process transformers model on the same global batch.
    cfg, _ = load_and_validate(os.path.join(ROOT, "recipes/tiny-v3.yaml"), None, [f"data.path={data_dir}"])
    model, _ = reference_model(cfg)
    assert fp32["losses"][0] == pytest.approx(training_loss(model, data_dir, 1, global_batch=8), rel=1e-5)
    assert fp32["max_rel_diff"] == 0 and len(fp32["losses"]) == 2
    assert 0 < bf16["max_rel_diff"] <= gpu_check.PRECISION_RTOL and bf16["within"]  # really rounded, and close
    for key in [k for k in rows if k[0] == "speed"]:
        r = rows[key]
        assert r["seq_len"] == 64 and r["tokens_per_s"] > 0 and r["peak_memory"] > r["formula_bytes"] > 0
        assert r["mfu"] is None  # no peak FLOP/s for a CPU: no made-up MFU
    assert rows[("speed", "tiny-v2", "experts eager")]["params"] == sum(
        p.numel() for p in reference_model(load_and_validate(
            os.path.join(ROOT, "recipes/tiny-v3.yaml"), None, ["model.preset=tiny-v2", f"data.path={data_dir}"])[0])[0]
        .parameters())
    # On the CPU MLA's unequal head sizes leave sdpa its math kernel; flash attention refuses them.
    assert result["sdpa_chosen"] == {"causal, no mask": "MATH", "boolean mask": "MATH"}
    backends = {b["backend"]: b for b in result["sdpa_backends"]}
    assert backends["MATH"]["causal, no mask"].endswith(" ms")
    assert backends["FLASH_ATTENTION"]["causal, no mask"].startswith("refused")
    assert result["nccl"].startswith("not run") and [w for w, _ in result["not_run"]] == [
        "fp16 precision run", "train.compile=true"]
    md = (tmp_path / "gpu.md").read_text()
    for heading in ("# GPU check (--smoke", "## Precision", "## Speed and memory", "## Attention", "## NCCL",
                    "## Not run", "## Environment"):
        assert heading in md
