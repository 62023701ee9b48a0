"""`deepseek-ds bench zero`: the formula with DeepSpeed's padding, and a real 2-rank run of stages 0-3 whose
measured optimizer bytes must equal that formula exactly."""

import csv
import json
import math
import os
import re

import pytest

from deepseek_ds.bench import zero_bench
from deepseek_ds.bench.launch import WORKER_MODULE, worker_command
from deepseek_ds.bench.zero_bench import stage_ds_config, zero_formula
from deepseek_ds.cli import build_parser
from deepseek_ds.utils.zero_partition import partition_numel
from helpers import ROOT, cli, launch_env

# Odd sizes on purpose: kv_lora_rank 33 makes two parameters odd and Ψ % 4 == 2, so ZeRO-3's per-parameter
# padding and ZeRO 1/2's padding of the flat group to a multiple of 2N both add elements.
MODEL_SETS = ["model.overrides.kv_lora_rank=33", "model.overrides.num_hidden_layers=2"]


@pytest.mark.unit
def test_formula_is_the_papers_in_mixed_precision():
    psi, n = 7.5e9, 64  # the paper's example: 7.5B parameters on 64 GPUs
    totals = [sum(zero_formula(psi, n, s, param_bytes=2, master=True).values()) / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.40625, 16.640625, 1.875])  # the paper's Table: 120, 31.4, 16.6, 1.9 GB
    fp32 = [sum(zero_formula(psi, n, s, 4, master=zero_bench.has_master_copy(s, "fp32")).values()) for s in range(4)]
    assert fp32 == pytest.approx([16 * psi, 8 * psi + 12 * psi / n, 4 * psi + 16 * psi / n, 20 * psi / n])


@pytest.mark.unit
def test_partition_numel_pads_like_deepspeed():
    assert partition_numel([5, 3], n=2, stage=0) == 8
    assert partition_numel([5, 3], n=2, stage=3) == 3 + 2        # every parameter padded to a multiple of N
    assert partition_numel([5, 4], n=2, stage=1) == 12 // 2       # the flat group (9) padded to a multiple of 2N
    assert partition_numel([5, 4], n=3, stage=2) == 12 // 3


@pytest.mark.unit
def test_stage_configs_offload_only_where_deepspeed_accepts_it():
    base = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5}}
    assert stage_ds_config(base, 0, offload=True)["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 5}
    assert "offload_param" not in stage_ds_config(base, 2, offload=True)["zero_optimization"]
    z3 = stage_ds_config(base, 3, offload=True)
    assert zero_bench.offload_label(z3) == "optimizer+params"
    assert base == {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5}}


@pytest.mark.unit
def test_the_worker_is_launched_with_the_launcher_options_and_the_run():
    args = build_parser().parse_args(["bench", "zero", "--config", "r.yaml", "-H", "hosts", "-i", "node-0:0,1",
                                      "--master-port", "29612", "--launcher-args=--ssh_port 2222", "--steps", "3"])
    cmd = worker_command(args, world=2, global_batch_sizes=[8, 16], sets=["a.b=1"], deepspeed_config="z.json",
                         result="out.json")
    module = cmd.index("--module")
    assert cmd[1:module] == ["--master_port", "29612", "--hostfile", "hosts", "--include", "node-0:0,1",
                             "--ssh_port", "2222"]
    assert cmd[module + 1:] == [WORKER_MODULE, "--config", "r.yaml", "--result", os.path.abspath("out.json"),
                                "--global-batch-sizes", "8,16", "--warmup", "2", "--steps", "3",
                                "--deepspeed_config", "z.json", "--set", "a.b=1"]


def _model_numels() -> list[int]:
    """The parameter sizes, from the model built here, independently of the benchmark's measurement."""
    from deepseek_ds.models.pipeline import build_model, prepare_config
    from deepseek_ds.models.presets import build_model_config

    cfg = prepare_config(build_model_config("tiny-v3", None, {"kv_lora_rank": 33, "num_hidden_layers": 2}))
    return [p.numel() for p in build_model(cfg, 1, seed=1).parameters()]


@pytest.mark.launch
def test_bench_zero_measures_the_formula_and_writes_the_report(tmp_path, data_dir, monkeypatch):
    for key, value in launch_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "zero"
    sets = [f"data.path={data_dir}", "data.seq_len=32", "train.micro_batch_size=2", *MODEL_SETS]
    # --allow-busy: the test host is shared; the refusal itself is test_a_busy_host_is_refused_before_any_launch's.
    assert cli(["bench", "zero", "--config", "recipes/tiny-v3.yaml", "--nproc", "2", "--steps", "1",
                "--warmup", "1", "--allow-busy", "--out", str(out)] + [a for s in sets for a in ("--set", s)]) == 0

    for name in ("zero.md", "zero.csv", "zero_memory.png", "zero_speed.png"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "zero.md").read_text()
    assert re.search(r"^\| ZeRO +\|", md, re.M) and "## Environment" in md and "git commit" in md and "deepspeed" in md

    with open(out / "zero.csv") as f:
        rows = {int(r["stage"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [0, 1, 2, 3]
    numels = _model_numels()
    psi, n = sum(numels), 2
    assert psi % 4 and any(x % 2 for x in numels)  # padding really happens
    aligned = math.ceil(psi / (2 * n)) * 2 * n
    expected_optimizer = {
        0: 8 * psi,                                              # fp32 Adam moments, no master copy
        1: 12 * aligned // n,                                    # master + 2 moments of a 1/N slice of the flat group
        2: 12 * aligned // n,
        3: 12 * sum(math.ceil(x / n) for x in numels),           # 1/N of every padded parameter
    }
    for stage, row in rows.items():
        assert int(row["psi"]) == psi
        assert int(row["optimizer_bytes"]) == expected_optimizer[stage], f"ZeRO-{stage}"
        assert row["optimizer_exact"] == "True"
        assert row["losses_agree"] == "True", f"ZeRO-{stage}: rel. diff {row['loss_rel_diff']}"
        assert float(row["tokens_per_s"]) > 0 and int(row["peak_memory_bytes"]) > 0
    # Parameters are held whole below stage 3: 4 bytes each, ZeRO 1/2 in their padded flat buffer.
    assert int(rows[0]["params_bytes"]) == 4 * psi
    assert int(rows[1]["params_bytes"]) == int(rows[2]["params_bytes"]) == 4 * aligned
    # Stage 1 keeps full gradients while accumulating (grad-accum 2); stage 2 only its partition.
    assert int(rows[1]["grads_bytes"]) >= 4 * psi > int(rows[2]["grads_bytes"])
    assert int(rows[3]["params_bytes"]) < int(rows[2]["params_bytes"])
    # Every stage's gradient bucket (reduce_bucket_size fp32 elements) is seen, ZeRO-2's too although it frees
    # it after each backward: the categories are taken at the same points of the step for every stage.
    with open(os.path.join(ROOT, "ds_configs", "zero1.json")) as f:
        bucket = 4 * int(json.load(f)["zero_optimization"]["reduce_bucket_size"])
    for stage in (1, 2, 3):
        assert int(rows[stage]["buffers_bytes"]) >= bucket, f"ZeRO-{stage}"
        assert int(rows[stage]["buffers_bytes"]) < bucket + 4 * psi, f"ZeRO-{stage}"


@pytest.mark.unit
def test_muon_rows_take_plans_bytes_per_rank():
    """With DeepSpeed's Muon, the row's expectation for each rank comes from the engine's tags and shapes as the worker
    reports them, and equals `plan`'s from the layer specs (test_muon.py checks both against real engines); losses are
    compared within one optimizer only."""
    from deepseek_ds.models.muon import layer_shape, muon_split
    from deepseek_ds.models.pipeline import build_model, prepare_config
    from deepseek_ds.models.presets import build_model_config
    from deepseek_ds.plan.params import SpecParams, rank_params
    from deepseek_ds.plan.states import PERSISTENCE_DEFAULT, ZeroSettings, state_bytes

    cfg = prepare_config(build_model_config("tiny-v3", None, {}))
    model = build_model(cfg, 1, seed=1)
    split = muon_split(model)
    params = list(model.parameters())
    spec = SpecParams(cfg)
    planned = rank_params(spec, spec.bounds(1, "parameters", 64), 0, 1, 1)
    for stage in (1, 2, 3):
        reports = [{"rank": r, "dp_rank": r, "dp_size": 2, "param_numels": [p.numel() for p in params],
                    "param_muon": list(split.values()), "param_shapes": [list(layer_shape(p)) for p in params],
                    "param_element_size": 4} for r in range(2)]
        for r in reports:
            plan = state_bytes(planned, ZeroSettings(stage, 4, PERSISTENCE_DEFAULT, muon=True), 2, 1, r["dp_rank"])
            assert zero_bench.expected_rank_optimizer_bytes(r, stage, master=True) == plan.optimizer, (stage, r)
        adamw = zero_bench.expected_rank_optimizer_bytes({**reports[0], "param_muon": None}, stage, master=True)
        assert (plan.optimizer < adamw) is (stage == 3)
    rows = [{"optimizer": o, "losses": losses, "precision": "fp32"}
            for o, losses in (("AdamW", [2.0]), ("AdamW", [2.0]), ("Muon", [1.5]), ("Muon", [1.5]))]
    zero_bench.compare_losses(rows, None)
    assert all(r["losses_agree"] for r in rows)
