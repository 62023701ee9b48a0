"""Tensor parallelism (parallel.tensor_parallel, DeepSpeed AutoTP): the losses equal the single-process transformers
+ AdamW reference, each rank holds exactly 1/TP of the split matrices, checkpoints resume bit for bit and export
gathers the shards; the layouts AutoTP cannot carry are refused before launch."""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import load_file

from deepseek_ds.config import load_ds_config, load_run_config, resolve_ds_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.models.tensor_parallel import split_dim, tensor_parallel_section
from helpers import ROOT, checkpoint_sets, cli, fresh_ckpt_dir, losses, read_metrics, refused, train, train_layouts
from reference import reference_losses, reference_model

# Adam's eps and the seed: clear of routing near ties, as in test_equivalence.SETS.
SEED = 7
SETS = ["train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64", "train.warmup_steps=0",
        "eval.interval=0", "train.eps=1e-5", f"train.seed={SEED}"]
TP2 = ["parallel.tensor_parallel=2"]

# The matrices tensor parallelism splits, by the HF name's last two parts (the expected layout, written apart from
# models/tensor_parallel.py's patterns): dense attention and MLPs, MLA's up-projections from the latents, the
# shared experts. Everything else (norms, embeddings, head, router, MLA down-projections, routed experts) is whole.
SPLIT = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_b_proj",
         "self_attn.kv_b_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "shared_experts.gate_proj",
         "shared_experts.up_proj", "shared_experts.down_proj"}
_SHARDS = re.compile(r"tensor parallel 2: this rank holds (\d+) elements of split weights, (\d+) parameters in all")


def _cfg(recipe: str, data_dir: str, steps: int, *extra: str):
    return load_run_config(os.path.join(ROOT, recipe), SETS + [f"data.path={data_dir}", f"train.steps={steps}", *extra])


def _element_counts(cfg) -> tuple[int, int]:
    """(elements of the split matrices, of all parameters) of the unsplit transformers model."""
    model, _ = reference_model(cfg)
    split = sum(p.numel() for name, p in model.named_parameters()
                if ".".join(name.split(".")[-3:-1]) in SPLIT)
    return split, sum(p.numel() for p in model.parameters())


def _rank_shards(out) -> list[tuple[int, int]]:
    found = []
    for rank in (0, 1):
        with open(os.path.join(out, "logs", f"rank{rank}.log")) as f:
            found.append(tuple(int(v) for v in _SHARDS.search(f.read()).groups()))
    return found


def _check_against_reference(records, reference, cfg, out) -> None:
    got = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, len(reference) + 1))
    assert got == pytest.approx(reference, rel=1e-5), f"{got} vs reference {reference}"
    assert len(set(reference)) == len(reference)  # the reference really trains
    split, total = _element_counts(cfg)
    assert split > 0 and split % 2 == 0
    assert _rank_shards(out) == [(split // 2, total - split // 2)] * 2


# ----------------------------------------------------------------------------------------------- launches
EVAL_AT_4 = ["eval.interval=4", "eval.batches=2"]
DENSE = "model.preset=tiny-dense"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, data_dir) -> dict:
    """This file's 2-rank TP=2 runs (ZeRO-1), one after the other in ONE launch of tests/tp_worker.py (one start-up):
    v3: tiny-v3, 4 steps, saves at 2 and 4; resumed: v3's step-2 checkpoint resumed to step 4, validating at 4;
    lr0: tiny-v3 from an HF directory of scaled weights (in/), 1 step at lr 0; dense: tiny-dense, 3 steps."""
    root = tmp_path_factory.mktemp("tp2")
    model, _ = reference_model(_cfg("recipes/tiny-v3.yaml", data_dir, 1))
    with torch.no_grad():  # weights the seeded init would not give: equality proves they went through
        for p in model.parameters():
            p.mul_(1.5)
    model.save_pretrained(root / "in")
    step2 = root / "v3" / "checkpoints" / "step00000002"
    layouts = [
        ("v3", "ds_configs/zero1.json", checkpoint_sets(data_dir, 4, 2)),
        ("resumed", "ds_configs/zero1.json", checkpoint_sets(data_dir, 4, 2, *EVAL_AT_4,
                                                              f"checkpoint.dir={root / 'resumed_ckpt'}")),
        ("lr0", "ds_configs/zero1.json", checkpoint_sets(data_dir, 1, 0, f"model.path={root / 'in'}",
                                                         "model.preset=null", "train.lr=0", "train.min_lr=0",
                                                         "moe.bias_update_speed=0")),  # the bias moves without a lr
        # tiny-dense.yaml's run, as tiny-v3.yaml + this preset (test_tiny_dense_tp2_equals_reference checks that).
        ("dense", "ds_configs/zero1.json", checkpoint_sets(data_dir, 3, 0, DENSE)),
    ]
    outs = train_layouts(2, root, layouts, [*SETS, *TP2], worker="tests/tp_worker.py",
                         worker_args=("--resume-from", str(root / "resumed_ckpt"), str(step2)))
    return {"root": root, "step2": step2, **{name: (out, read_metrics(str(out))) for name, out in outs.items()}}


@pytest.mark.launch
def test_tiny_v3_tp2_equals_reference_and_splits_by_heads(tp2, data_dir):
    """MLA split by heads (q_b_proj / kv_b_proj column, o_proj row), shared experts split, routed experts whole:
    4 steps equal the reference (steps 2-4 check gradients, clipping, AdamW and the rope key's summed gradient),
    the balance loss too, and each rank holds half of the split matrices."""
    cfg = _cfg("recipes/tiny-v3.yaml", data_dir, 4)
    out, records = tp2["v3"]
    moe_log = []
    _check_against_reference(records, reference_losses(cfg, data_dir, moe_log=moe_log), cfg, out)
    aux = [r["aux_loss"] for r in records]
    assert aux == pytest.approx([m["aux_loss"] for m in moe_log], rel=1e-5)
    # Both TP ranks route the replica's tokens: they are counted once (each goes to top_k experts).
    mcfg = build_model_config(cfg.model.preset)
    mean = cfg.train.global_batch_size * cfg.data.seq_len * mcfg.num_experts_per_tok / mcfg.n_routed_experts
    for r in records:
        for layer in range(mcfg.first_k_dense_replace, mcfg.num_hidden_layers):
            assert r[f"moe/layer{layer}/load_mean"] == mean


@pytest.mark.launch
def test_tiny_v3_tp2_resume_bitwise_reshard_to_tp1_and_export_gathers_the_shards(tp2, data_dir, tmp_path):
    """Resuming the TP=2 checkpoint of step 2 repeats steps 3-4 bit for bit, and on TP=1 within 1e-5; the step-4
    validation of both agrees (the TP ranks of a replica count its tokens once); `export hf` of that checkpoint
    gathers the shards into whole matrices, and transformers' model from them computes step 3's logged loss."""
    from transformers import AutoModelForCausalLM

    from helpers import training_loss

    _, records = tp2["resumed"]
    resumed = losses(records)
    first = losses(tp2["v3"][1])
    assert resumed == {3: first[3], 4: first[4]}
    # TP=2 -> TP=1 on one rank: resharded through a universal checkpoint (AutoTP's own conversion info, saved with
    # the checkpoint, says which tensors are split); step 4 also checks that Adam's moments followed.
    ckpt = fresh_ckpt_dir(tp2["step2"], tmp_path / "ckpt_tp1")
    records_tp1 = train(1, str(tmp_path / "out_tp1"), checkpoint_sets(data_dir, 4, 2, *SETS, *EVAL_AT_4,
                                                                      f"checkpoint.dir={ckpt}"))
    resharded = losses(records_tp1)
    assert sorted(resharded) == [3, 4]
    assert all(abs(resharded[s] - first[s]) < 1e-5 for s in (3, 4)), (resharded, first)
    tp2_eval, tp1_eval = (next(r for r in recs if r.get("eval_loss") is not None) for recs in (records, records_tp1))
    assert tp2_eval["eval_tokens"] == tp1_eval["eval_tokens"] > 0
    assert tp2_eval["eval_loss"] == pytest.approx(tp1_eval["eval_loss"], rel=1e-5)
    assert cli(["export", "hf", str(tp2["step2"]), "--out", str(tmp_path / "hf"), "--dtype", "fp32",
                "--work-dir", str(tmp_path)]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.model.layers[1].self_attn.q_b_proj.weight.shape[0] == 4 * 48  # all heads, not one rank's half
    assert abs(training_loss(model, data_dir, 3, seq_len=64, global_batch=8, micro_batch=8, seed=SEED) - first[3]) < 1e-5


@pytest.mark.launch
def test_export_of_a_tp2_checkpoint_gives_back_the_input_weights_bitwise(tp2, tmp_path):
    """HF directory -> 1 step at lr 0 with TP=2 -> checkpoint -> `export hf`: every tensor equal, bit for bit."""
    out, _ = tp2["lr0"]
    assert cli(["export", "hf", str(out / "checkpoints"), "--out", str(tmp_path / "hf"), "--dtype", "fp32",
                "--work-dir", str(tmp_path)]) == 0
    given = load_file(tp2["root"] / "in" / "model.safetensors")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(given)
    assert all(torch.equal(exported[k], given[k]) for k in given), \
        [k for k in given if not torch.equal(exported[k], given[k])][:5]


@pytest.mark.launch
def test_tiny_dense_tp2_equals_reference(tp2, data_dir):
    """Llama layout: q/k/v/gate/up column-parallel, o/down row-parallel; 3 steps equal the reference."""
    cfg = _cfg("recipes/tiny-dense.yaml", data_dir, 3)
    # The launch trained tiny-v3.yaml with the dense preset: the run tiny-dense.yaml describes, field for field.
    launched = [*SETS, *TP2, *checkpoint_sets(data_dir, 3, 0), "train.output_dir=out"]
    assert (load_run_config(os.path.join(ROOT, "recipes/tiny-v3.yaml"), [*launched, DENSE])
            == load_run_config(os.path.join(ROOT, "recipes/tiny-dense.yaml"), launched))
    out, records = tp2["dense"]
    _check_against_reference(records, reference_losses(cfg, data_dir), cfg, out)


@pytest.mark.launch
def test_tiny_v3_tp2_x_dp2_on_4_ranks_equals_reference(data_dir, tmp_path):
    """TP=2 x DP=2: both TP ranks of a replica read the same batch, the two replicas different ones."""
    cfg = _cfg("recipes/tiny-v3.yaml", data_dir, 3)
    out = tmp_path / "out"
    records = train(4, str(out), checkpoint_sets(data_dir, 3, 0, *SETS, *TP2))
    _check_against_reference(records, reference_losses(cfg, data_dir), cfg, out)


# ----------------------------------------------------------------------------------------------- refusals (unit)
def _unit_cfg(*extra: str, recipe: str = "recipes/tiny-v3.yaml"):
    return load_run_config(os.path.join(ROOT, recipe), ["data.builtin=stdlib", *extra])


def _ds(name: str = "zero1.json") -> dict:
    return load_ds_config(os.path.join(ROOT, "ds_configs", name))


@pytest.mark.unit
def test_the_resolved_deepspeed_json_carries_the_autotp_section():
    resolved = resolve_ds_config(_ds(), _unit_cfg(*TP2), 2)
    assert resolved["tensor_parallel"] == tensor_parallel_section("deepseek_v3", 2)
    assert resolved["tensor_parallel"]["autotp_size"] == 2
    assert "tensor_parallel" not in resolve_ds_config(_ds(), _unit_cfg(), 2)


@pytest.mark.unit
@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "llama"])
def test_partition_config_splits_what_the_layout_says(model_type):
    """Every parameter name of the model against the expected split (SPLIT above): column (0) for the matrices
    whose outputs are heads or MLP channels, row (1) for o_proj / down_proj, None for everything else."""
    preset = {"deepseek_v3": "tiny-v3", "deepseek_v2": "tiny-v2", "llama": "tiny-dense"}[model_type]
    cfg = load_run_config(os.path.join(ROOT, "recipes", f"{preset}.yaml"), [])
    from deepseek_ds.models.pipeline import build_model

    model = build_model(build_model_config(cfg.model.preset), 1, seed=None)
    seen = set()
    for name, _ in model.named_parameters():
        module = ".".join(name.split(".")[-3:-1])
        expected = (1 if module.endswith(("o_proj", "down_proj")) else 0) if module in SPLIT else None
        assert split_dim(name, model_type) == expected, name
        seen.add(expected)
    assert seen == {0, 1, None}


@pytest.mark.unit
def test_tensor_parallel_refusals():
    ds = _ds()
    msg = refused(_unit_cfg(*TP2), ds, 3, match="world size 3 is not divisible")
    assert "pipeline_stages(1)" in msg and "tensor_parallel(2)" in msg and "dp" in msg
    refused(_unit_cfg(*TP2), _ds("zero3.json"), 2, match=r"ZeRO stage 3: deepseek-ds supports DeepSpeed AutoTP "
                                                           r"training with ZeRO 0-2 only")
    refused(_unit_cfg(*TP2, "parallel.pipeline_stages=2"), _ds("zero1_pp.json"), 4,
            match=r"pipeline engine cannot carry it")
    refused(_unit_cfg(*TP2, "parallel.expert_parallel=2", "train.global_batch_size=32"), ds, 4,
            match=r"parallel.expert_parallel \(2\).*set one of them to 1")
    refused(_unit_cfg("parallel.tensor_parallel=8", "train.global_batch_size=8", "train.micro_batch_size=8"), ds, 8,
            match=r"must divide the attention heads \(num_attention_heads 4, num_key_value_heads 4\)")
    refused(_unit_cfg("parallel.tensor_parallel=3", "model.overrides.num_attention_heads=6",
                      "model.overrides.num_key_value_heads=6", "train.global_batch_size=8",
                      "train.micro_batch_size=8"), ds, 3, match=r"must divide intermediate_size \(384\)|"
                                                                   r"must divide moe_intermediate_size")
    refused(_unit_cfg(*TP2, "model.overrides.num_key_value_heads=1", recipe="recipes/tiny-dense.yaml"), ds, 2,
            match=r"num_key_value_heads 1")
    refused(_unit_cfg(*TP2, "lora.r=4"), ds, 2, match=r"lora.r > 0")
    refused(_unit_cfg(*TP2, "model.overrides.num_nextn_predict_layers=1"), ds, 2, match=r"MTP module")
    refused(_unit_cfg(), {**ds, "tensor_parallel": {"autotp_size": 2}}, 2,
            match=r"set parallel.tensor_parallel in the run YAML")


@pytest.mark.launch
def test_bench_zero_with_tp2_reports_half_of_the_split_matrices_per_rank(data_dir, tmp_path, monkeypatch):
    """`bench zero --tp 2`: each rank's measured parameter bytes are its fp32 shard, whole model minus half the
    split matrices."""
    import csv

    monkeypatch.chdir(ROOT)
    out = tmp_path / "zero"
    sets = [f"data.path={data_dir}", "data.seq_len=32", "train.micro_batch_size=2", "eval.interval=0"]
    assert cli(["bench", "zero", "--config", "recipes/tiny-v3.yaml", "--nproc", "2", "--tp", "2", "--stages", "1",
                "--steps", "1", "--warmup", "1", "--allow-busy", "--out", str(out)]
               + [a for s in sets for a in ("--set", s)]) == 0
    with open(out / "zero.csv") as f:
        (row,) = list(csv.DictReader(f))
    split, total = _element_counts(_cfg("recipes/tiny-v3.yaml", data_dir, 1))
    assert (int(row["tp"]), int(row["ranks"]), int(row["psi"])) == (2, 1, total - split // 2)
    assert int(row["params_bytes"]) == 4 * (total - split // 2)
    assert "1 data-parallel ranks x 2 tensor-parallel" in (out / "zero.md").read_text()
