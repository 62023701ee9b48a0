"""scripts/gpu_check.sh: its CPU smoke mode end to end (what CI runs), the full GPU plan checked without a GPU
(every variant passes validate() and has the sizes it claims), its refusal to run the full check on a CPU, a failing
part or the deadline costing no other part its results, and bench.worker.measure leaving no engine alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import DeepseekV2ForCausalLM, LlamaForCausalLM

from deepseek_ds.bench import gpu_check, gpu_report
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
        ("speed", "compile off"), ("speed", "experts grouped_mm"), ("speed", "experts eager"), ("speed", "compile on")]
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
    assert result["errors"] == [] and result["running"] is None and result["notes"][0].startswith("FusedAdam")
    assert fp32["skipped_steps"] == bf16["skipped_steps"] == 0 and fp32["peak_reserved"] is None  # CUDA's only
    md = (tmp_path / "gpu.md").read_text()
    for heading in ("# GPU check (--smoke", "## Notes", "## Precision", "## Attention", "## Speed and memory",
                    "## NCCL", "## Errors\n\nnone", "## Not run", "## Environment"):
        assert heading in md


def fake_row(v: gpu_check.Variant, work_dir: str) -> dict:
    if v.option == "bf16":
        raise RuntimeError("CUDA out of memory (a stand-in)")
    return {"section": v.section, "model": v.model, "option": v.option, "losses": [2.0, 1.0], "ds": v.ds_config}


@pytest.mark.unit
def test_a_failing_part_costs_no_other_part_its_results(data_dir, tmp_path, monkeypatch, capsys):
    """bf16's variant and the attention part raise, FusedAdam does not build: everything else still runs, on
    torch's AdamW, and the report lists the errors; the error rows are left out of the precision comparison."""
    monkeypatch.setenv("RANK", "0")  # no process group: the variants are faked
    monkeypatch.setattr(gpu_check, "run_variant", fake_row)
    monkeypatch.setattr(gpu_check, "fused_adam", lambda: (False, "FusedAdam failed to build (stand-in)"))
    monkeypatch.setattr(gpu_check, "attention_backends", lambda *a, **k: 1 / 0)
    md = tmp_path / "out" / "gpu.md"
    results = gpu_check.run_gpu_check(True, data_dir, str(tmp_path / "work"), str(md))
    result = json.loads((tmp_path / "work" / "gpu_check.json").read_text())
    assert [(r["option"], "error" in r) for r in result["rows"]] == [
        ("fp32", False), ("bf16", True), ("compile off", False), ("experts grouped_mm", False),
        ("experts eager", False)]
    assert result["errors"] == [["precision: tiny-v3, bf16", "RuntimeError: CUDA out of memory (a stand-in)"],
                                ["attention (sdpa backends)", "ZeroDivisionError: division by zero"]]
    fp32 = result["rows"][0]
    assert fp32["within"] and fp32["max_rel_diff"] == 0
    for r in result["rows"]:  # every variant on a copy of its config with torch_adam
        assert "error" in r or gpu_check.load_ds_config(r["ds"])["optimizer"]["params"]["torch_adam"] is True
    assert "torch's AdamW" in result["notes"][0] and result["sdpa_backends"] is None
    text = md.read_text()
    assert "- precision: tiny-v3, bf16: RuntimeError: CUDA out of memory" in text and "not measured" in text
    assert gpu_check.exit_status(results) == 4 and "2 part(s) failed" in capsys.readouterr().err


@pytest.mark.unit
def test_parts_past_the_deadline_are_listed_as_not_run(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(gpu_check, "run_variant", fake_row)
    results = gpu_check.run_gpu_check(True, data_dir, str(tmp_path), str(tmp_path / "gpu.md"), deadline_s=0)
    assert results.rows == [] and results.errors == [] and gpu_check.exit_status(results) == 0
    skipped = [what for what, why in results.not_run if why.startswith("skipped: past --deadline-s")]
    assert skipped == ["FusedAdam build", "precision: tiny-v3, fp32", "precision: tiny-v3, bf16",
                       "attention (sdpa backends)", "speed: tiny-dense, compile off",
                       "speed: tiny-v2, experts grouped_mm", "speed: tiny-v2, experts eager"]
    assert "## Not run" in (tmp_path / "gpu.md").read_text()


@pytest.mark.unit
def test_a_killed_part_is_named_in_the_report(tmp_path):
    """The report is saved as each part starts: one the time limit kills is listed as started, not finished."""
    results = gpu_report.Results(False, 0.02, 8, running="speed: dense ~1B, compile on")
    gpu_report.write_report(str(tmp_path / "gpu.md"), results, {"git commit": "abc"})
    assert "- speed: dense ~1B, compile on: started, but the check ended" in (tmp_path / "gpu.md").read_text()


# Two variants through bench.worker.measure in one process, the second failing mid-step: after each, no
# DeepSpeedEngine may be left (its model and optimizer would inflate the next variant's peak memory).
LIVE_ENGINES = """
import argparse, gc, sys
from deepspeed.runtime.engine import DeepSpeedEngine
from deepseek_ds.bench import worker
from deepseek_ds.bench.checkpoint_bench import single_process_env

def live():
    return sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())

single_process_env()
data, out = sys.argv[1:]
args = argparse.Namespace(config="recipes/tiny-v3.yaml", deepspeed_config="ds_configs/zero1.json", warmup=0, steps=0,
                          set=[f"data.path={data}", f"train.output_dir={out}", "eval.interval=0",
                               "checkpoint.interval=0", "train.steps=1", "data.seq_len=32"])
worker.measure(args, 1, 8)
print("after a variant:", live())
def fail(run, batch):
    raise RuntimeError("stand-in")
worker.train_step = fail
try:
    worker.measure(args, 1, 8)
except RuntimeError:
    pass
worker.free_memory()
print("after a failed variant:", live())
"""


@pytest.mark.launch
def test_measure_leaves_no_engine_alive(data_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-c", LIVE_ENGINES, data_dir, str(tmp_path)], cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "after a variant: 0" in proc.stdout and "after a failed variant: 0" in proc.stdout
