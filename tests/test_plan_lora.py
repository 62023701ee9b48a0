"""`plan` for fine-tuning: LoRA's step time without the frozen weights' gradient matmuls (against FLOPs counted from
the transformers model itself), GPU presets with datasheet memory and peak (and the GPU a plan assumed, said), and a
recipe whose model.path is not on this machine planned from the preset it names; LoRA under AutoEP, each rank with
its own experts and their adapters in the expert-data-parallel group."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from deepseek_ds.config import load_ds_config, load_run_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.plan.estimate import estimate, layout_of
from deepseek_ds.plan.params import SpecParams
from deepseek_ds.plan.steptime import Hardware, step_time
from helpers import cli

SEVEN_B = ["model.path=null", "model.preset=deepseek-llm-7b", "data.builtin=stdlib", "data.seq_len=2048",
           "train.micro_batch_size=1", "train.global_batch_size=4"]
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _compute_s(sets: list[str], hw: Hardware) -> float:
    cfg = load_run_config("recipes/tiny-dense.yaml", [*SEVEN_B, *sets])
    ds = load_ds_config("ds_configs/zero3_bf16.json")
    model = SpecParams(cfg.model.hf_config)
    plan = estimate(cfg, ds, layout_of(cfg, ds, 1), 2**40, True, model)
    return step_time(cfg, plan, hw, model).compute_s


@pytest.mark.unit
def test_lora_skips_the_frozen_weights_gradient_matmuls():
    """Per token: a weight matmul costs 2 x its parameters forward, 2 for the input's gradient and 2 for the
    weight's; frozen weights skip the last. Counted here from the transformers Llama itself (meta device)."""
    r, seq, tokens = 16, 2048, 4 * 2048
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(build_model_config("deepseek-llm-7b"))
    c = hf.config
    weights = sum(p.numel() for n, p in hf.named_parameters() if "embed_tokens" not in n)  # a lookup: no matmul
    adapters = sum(r * (m.in_features + m.out_features) for n, m in hf.named_modules()
                   if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in LLAMA_TARGETS)
    head_dim = c.hidden_size // c.num_attention_heads
    attention = c.num_hidden_layers * 6 * c.num_attention_heads * seq * 2 * head_dim // 2  # causal: half the square
    hw = Hardware(peak_tflops=989.0, mfu=0.4, bandwidth=50e9, intra_bandwidth=300e9, gpus_per_node=8)
    rate = 989e12 * 0.4
    full, lora = _compute_s([], hw), _compute_s(["lora.r=16", "lora.alpha=32"], hw)
    assert full == pytest.approx(tokens * (6 * weights + attention) / rate, rel=1e-9)
    assert lora == pytest.approx(tokens * (4 * weights + 6 * adapters + attention) / rate, rel=1e-9)
    assert 0.68 < lora / full < 0.69  # a 7B at 2,048 tokens: about a third less compute


@pytest.mark.unit
@pytest.mark.parametrize("gpu, memory, peak", [("h100", 80, 989.4), ("h200", 141, 989.4), ("a100", 80, 312.0),
                                               ("l40s", 48, 362.1), ("4090", 24, 165.2)])
def test_gpu_presets_give_memory_and_peak_and_the_plan_says_which(gpu, memory, peak, capsys):
    args = ["plan", "--config", "recipes/tiny-v3.yaml", "--num_gpus", "1", "--gpu", gpu]
    cli([*args, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_memory_bytes"] == memory * 2**30 and out["peak_tflops"] == peak and out["gpu"] == gpu
    cli(args)
    assert f"{peak:g} TFLOP/s bf16 dense peak of the --gpu {gpu} preset" in capsys.readouterr().out
    # --gpu-memory and --peak-tflops given beside a preset win.
    cli([*args, "--json", "--gpu-memory", "10GB", "--peak-tflops", "100"])
    out = json.loads(capsys.readouterr().out)
    assert (out["gpu_memory_bytes"], out["peak_tflops"]) == (10 * 2**30, 100.0)


@pytest.mark.unit
def test_a_plan_without_a_gpu_says_it_assumed_an_h100(capsys):
    base = ["plan", "--config", "recipes/tiny-v3.yaml", "--num_gpus", "1", "--gpu-memory", "24GB"]
    cli(base)
    assert "989.4 TFLOP/s assumed (an H100's bf16 dense peak): pass --gpu or --peak-tflops for yours" in \
        capsys.readouterr().out
    cli([*base, "--peak-tflops", "165.2"])
    assert "165.2 TFLOP/s (--peak-tflops)" in capsys.readouterr().out
    assert cli(["plan", "--config", "recipes/tiny-v3.yaml", "--num_gpus", "1"]) == 2
    assert "pass --gpu-memory SIZE or --gpu" in capsys.readouterr().err


@pytest.mark.unit
def test_a_recipe_whose_model_path_is_absent_is_planned_from_its_preset(capsys, tmp_path):
    # The recipe's /models/DeepSeek-V2-Lite, at a path that is absent on any machine (a GPU host may have the model).
    absent = tmp_path / "models" / "DeepSeek-V2-Lite"
    args = ["plan", "--config", "recipes/sft-deepseek-v2-lite.yaml", "--num_gpus", "8", "--gpu", "h100", "--json"]
    assert cli([*args, "--set", f"model.path={absent}"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert captured.err.strip() == (f"note: model.path {absent} is not on this machine: planning from "
                                    "the deepseek-v2-lite preset")
    cli([*args, "--set", "model.path=null", "--set", "model.preset=deepseek-v2-lite"])
    reference = json.loads(capsys.readouterr().out)
    assert out == reference and out["model"] == "deepseek-v2-lite"
    # A path that names no preset: one line saying how to plan it.
    status = cli([*args, "--set", f"model.path={tmp_path / 'models' / 'my-model'}"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"deepseek-ds: error: model.path {tmp_path / 'models' / 'my-model'} is not "
                                          "on this machine and names no preset: set model.preset")



MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # LoRA's default on DeepSeek


@pytest.mark.unit
@pytest.mark.parametrize("routed, world", [(True, 2), (True, 4), (False, 2)])
def test_lora_under_autoep_shards_expert_adapters_over_the_expert_data_parallel_group(routed, world):
    """EP=2, ZeRO-1, fp32: a rank keeps its dense adapters' optimizer share over the data-parallel ranks, and its own
    experts' adapters (1/EP of them) sharded over the dp / EP ranks holding the same experts; the frozen experts 1/EP.
    Counted here from the transformers model on the meta device and the config's shapes, not from the planner."""
    r, ep = 4, 2
    cfg = load_run_config("recipes/tiny-v3.yaml", [f"lora.r={r}", f"lora.routed_experts={str(routed).lower()}",
                                                   f"parallel.expert_parallel={ep}", "train.micro_batch_size=4"])
    ds = load_ds_config("ds_configs/zero1.json")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(build_model_config("tiny-v3"))
    c = hf.config
    dense = sum(r * (m.in_features + m.out_features) for n, m in hf.named_modules()
                if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in MLA_TARGETS)
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    # Per expert: gate_up A (r, hidden), B (2 ffn, r); down A (r, ffn), B (hidden, r).
    h, ffn = c.hidden_size, c.moe_intermediate_size
    experts = moe_layers * c.n_routed_experts * r * (h + 2 * ffn + ffn + h) if routed else 0
    routed_base = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    frozen = sum(p.numel() for p in hf.parameters()) - routed_base + routed_base // ep
    assert dense and routed_base and experts % (ep * world) == 0 and dense % (2 * world) == 0  # no ZeRO padding

    lay = layout_of(cfg, ds, world)
    assert (lay.expert_parallel, lay.replicas, lay.zero_stage) == (ep, world, 1)
    plan = estimate(cfg, ds, lay, 2**40, True)
    rank = plan.ranks[0]
    edp = world // ep  # ranks holding the same experts
    assert rank.optimizer == 12 * (dense // world + experts // ep // edp)  # fp32 master + Adam's two moments
    assert rank.grads == 4 * (dense + experts // ep)  # ZeRO-1: whole fp32 gradients of what this rank trains
    assert rank.params == 4 * (frozen + dense + experts // ep)
    # The step's gradient all-reduces (ring, 2 (n-1)/n of the bytes) and ZeRO-1's all-gathers of the updated
    # parameters ((n-1)/n): dense adapters over the data-parallel ranks, expert adapters over their
    # expert-data-parallel group only (none with EP = dp); all-to-alls made free here, the metrics (< 1 kB) aside.
    hw = Hardware(peak_tflops=1.0, mfu=1.0, bandwidth=1.0, intra_bandwidth=1e30, gpus_per_node=8)
    want = 3 * (world - 1) / world * 4 * dense + 3 * (edp - 1) / edp * 4 * (experts // ep)
    assert step_time(cfg, plan, hw, SpecParams(cfg.model.hf_config), ds).comm_s == pytest.approx(want, abs=1000)
