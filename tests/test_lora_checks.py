"""LoRA's refusals and checkpoint checks that need no launch: MTP models, a run whose lora section is not its
checkpoint's (refused before any process starts), layout changes a LoRA or tensor-parallel checkpoint cannot make,
loss evaluation of a LoRA checkpoint (the merged model, against our own model holding the adapters), bf16 module
adapters refused, and bench lora's global batch under pipeline parallelism."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from deepseek_ds.checkpoint.format import (
    FORMAT_VERSION,
    META,
    CheckpointError,
    model_fingerprint,
    tag_for,
)
from deepseek_ds.checkpoint.integrity import FILES
from deepseek_ds.config import load_ds_config, load_run_config
from deepseek_ds.models.hf_io import load_hf_weights, to_hf_model
from deepseek_ds.models.lora import apply_lora
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.parallel.degrees import Layout
from helpers import refused
from tag_reference import read_back_record

LORA = ["lora.r=2", "lora.alpha=4"]


def _write_tag(ckpt, cfg, mcfg, module: dict[str, torch.Tensor], precision: str = "fp32", pipeline_stages: int = 1):
    """A published checkpoint of step 1 written by a ZeRO-0 run of `cfg` (its module states: `module`)."""
    tag = ckpt / tag_for(1)
    tag.mkdir(parents=True)
    mcfg.save_pretrained(tag)
    torch.save({"module": module}, tag / "mp_rank_00_model_states.pt")
    layout = Layout(1, pipeline_stages, zero_stage=0, precision=precision)
    meta = {"format_version": FORMAT_VERSION, "tag": tag.name, "step": 1, "consumed_samples": 8,
            "run_config": cfg.to_dict(), "layout": dataclasses.asdict(layout), "model_config": model_fingerprint(mcfg),
            "tokenizer_hash": "0" * 64, "dataset_dir": str(ckpt / "no-data")}
    meta[FILES] = read_back_record(tag)
    (tag / META).write_text(json.dumps(meta))
    return tag


@pytest.mark.unit
def test_lora_on_a_model_with_mtp_is_refused(data_dir):
    ds = load_ds_config("ds_configs/zero1.json")
    cfg = load_run_config("recipes/tiny-v3.yaml", [f"data.path={data_dir}", *LORA,
                                                   "model.overrides.num_nextn_predict_layers=1"])
    assert refused(cfg, ds, world=2, match=r"1 MTP module.*set model.overrides.num_nextn_predict_layers: 0")


@pytest.mark.unit
def test_a_run_whose_lora_section_is_not_its_checkpoints_is_refused_before_start(tmp_path):
    from deepseek_ds.checkpoint.existing import check_existing_checkpoint

    mcfg = prepare_config(build_model_config("tiny-v3"))

    def run(*sets: str):
        return load_run_config("recipes/tiny-v3.yaml", [f"checkpoint.dir={tmp_path / 'ckpt'}",
                                                        f"data.path={tmp_path / 'no-data'}", *sets])

    tag = _write_tag(tmp_path / "ckpt", run(), mcfg, {})  # a full fine-tuning checkpoint
    with pytest.raises(CheckpointError, match=r"trained with lora.r: 0, this run has lora.r: 2: set lora.r: 0"):
        check_existing_checkpoint(run(*LORA))
    assert check_existing_checkpoint(run("lora.target_modules=[o_proj]")) == tag.name  # r = 0: lora is off
    meta = json.loads((tag / META).read_text())
    meta["run_config"] = run(*LORA, "lora.target_modules=[o_proj]").to_dict()  # now a LoRA checkpoint
    (tag / META).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"trained with lora.r: 2, this run has lora.r: 0"):
        check_existing_checkpoint(run())
    with pytest.raises(CheckpointError, match=r'lora.target_modules: \["o_proj"\], this run has lora.target_modules: '
                                              r"null"):
        check_existing_checkpoint(run(*LORA))
    with pytest.raises(CheckpointError, match=r"lora.alpha: 4.0, lora.modules_to_save: \[\], this run has lora.alpha: "
                                              r'8.0, lora.modules_to_save: \["lm_head"\]'):
        check_existing_checkpoint(run(*LORA, "lora.target_modules=[o_proj]", "lora.alpha=8",
                                      "lora.modules_to_save=[lm_head]"))
    same = run(*LORA, "lora.target_modules=[o_proj]", "lora.dropout=0.1")  # dropout changes no tensor
    assert check_existing_checkpoint(same) == tag.name


@pytest.mark.unit
def test_layout_changes_of_lora_and_tensor_parallel_checkpoints():
    from deepseek_ds.checkpoint.resuming import _check_reshardable

    def layout(dp: int, tp: int = 1) -> Layout:
        return Layout(dp, tensor_parallel=tp, zero_stage=1)

    with pytest.raises(CheckpointError, match="a LoRA checkpoint holds only adapters.*resume with the saved layout"):
        _check_reshardable("ck", layout(2), layout(1), lora_r=4)
    _check_reshardable("ck", layout(2), layout(1), lora_r=0)  # full fine-tuning reshards
    _check_reshardable("ck", layout(1, tp=2), layout(2), lora_r=0)  # TP=2 -> 1: resharded
    for saved, now in ((1, 2), (4, 2)):
        with pytest.raises(CheckpointError, match=f"parallel.tensor_parallel = {now} but the checkpoint was trained "
                                                  f"with {saved}.*set parallel.tensor_parallel = {saved} or 1"):
            _check_reshardable("ck", layout(2, tp=saved), layout(2, tp=now), lora_r=0)


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """A ZeRO-0 LoRA checkpoint (adapters with B != 0 on tiny-v3's attention) over a base HF directory, and our own
    model holding the base and those adapters."""
    tmp = tmp_path_factory.mktemp("lora_checks")
    mcfg = prepare_config(build_model_config("tiny-v3"))
    base = tmp / "base"
    to_hf_model(local_layers(build_model(mcfg, 1, 3)), mcfg).save_pretrained(base)
    cfg = load_run_config("recipes/tiny-v3.yaml", ["model.preset=null", f"model.path={base}", *LORA])
    ours = build_model(mcfg, 1, 0)
    load_hf_weights(local_layers(ours), str(base), mcfg)
    apply_lora(ours, cfg.lora, mcfg, 0)
    gen = torch.Generator().manual_seed(2)
    adapters = {k: v for k, v in ours.state_dict().items() if ".lora_" in k}
    with torch.no_grad():
        for t in adapters.values():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
    tag = _write_tag(tmp / "ckpt", cfg, mcfg, adapters)
    return {"tag": tag, "cfg": cfg, "mcfg": mcfg, "ours": ours.eval(), "adapters": adapters}


@pytest.mark.unit
def test_loss_eval_of_a_lora_checkpoint_loads_the_merged_model(lora_checkpoint):
    from deepseek_ds.inference.eval import model_from_checkpoint, run_config_for

    tag = str(lora_checkpoint["tag"])
    model, _ = model_from_checkpoint(tag, run_config_for(tag, None, []))
    ids = torch.randint(0, lora_checkpoint["mcfg"].vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = lora_checkpoint["ours"](ids)
        assert (model.eval()(ids) - want).abs().max() < 1e-5
        plain = build_model(lora_checkpoint["mcfg"], 1, 0)
        load_hf_weights(local_layers(plain), lora_checkpoint["cfg"].model.path, lora_checkpoint["mcfg"])
        assert (plain.eval()(ids) - want).abs().max() > 1e-4  # the adapters change the model


@pytest.mark.unit
def test_bf16_module_adapters_are_refused(lora_checkpoint, tmp_path):
    from deepseek_ds.checkpoint import CheckpointError
    from deepseek_ds.inference.export_lora import peft_model_from_checkpoint

    c = lora_checkpoint
    for stages in (1, 2):  # ZeRO-0, and a pipeline's layer files
        tag = _write_tag(tmp_path / f"pp{stages}", c["cfg"], c["mcfg"], c["adapters"], "bf16", stages)
        with pytest.raises(CheckpointError, match="bf16 LoRA checkpoint of a pipeline, ZeRO-0 or expert-parallel run.*rounded copies"):
            peft_model_from_checkpoint(str(tag))


@pytest.mark.unit
def test_bench_lora_global_batch_counts_data_parallel_ranks(monkeypatch, tmp_path):
    """2 ranks as 2 pipeline stages are one replica: the global batch is micro x 1 x grad_accum."""
    from deepseek_ds.bench import lora_bench

    class Launched(Exception):
        pass

    def launch(args, world, global_batch_sizes, **kwargs):
        raise Launched(global_batch_sizes)

    monkeypatch.setattr(lora_bench, "launch", launch)
    monkeypatch.setattr(lora_bench, "load_and_validate", lambda *a, **k: None)  # no model.path weights here
    args = argparse.Namespace(num_gpus=2, hostfile=None, include="", exclude="", out=str(tmp_path),
                              config="recipes/tiny-v3.yaml", set=["parallel.pipeline_stages=2",
                                                                  "train.micro_batch_size=4"],
                              r=4, grad_accum=3, warmup=1, steps=2, deepspeed_config="ds_configs/zero1_pp.json")
    with pytest.raises(Launched) as e:
        lora_bench.run_lora_bench(args)
    assert e.value.args[0] == [4 * 1 * 3]
