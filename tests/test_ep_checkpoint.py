"""Checkpoints of expert-parallel runs (parallel.expert_parallel=2: DeepSpeed's AutoEP holds 4 of the 8 experts of
every MoE layer on each rank, the MTP module's included). `export hf` reassembles the experts: the export gives the
loss the run logged for the next step, and its tensors are the ones in DeepSpeed's own per-expert files. A resume
on another ZeRO stage or data-parallel size goes through a universal checkpoint and repeats the run; a resume
without expert parallelism is refused up front, naming parallel.expert_parallel. `eval` loads such a checkpoint.

One 3-step EP=2 ZeRO-1 run (saves at steps 2 and 3) is shared by the module; a ZeRO-2 resume and a 4-rank resume
of it are the other launches."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from deepseek_ds import checkpoint
from deepseek_ds.checkpoint import is_converted, universal_dir
from deepseek_ds.checkpoint.resuming import _check_reshardable, _loads_natively
from deepseek_ds.checkpoint.state import read_buffers
from deepseek_ds.models.names import hf_layer_prefix
from helpers import cli, fresh_ckpt_dir, losses, router_biases, train, training_loss

pytestmark = pytest.mark.launch

SEQ, MICRO, GLOBAL = 64, 2, 8
EP = ["parallel.expert_parallel=2", "model.overrides.num_nextn_predict_layers=1"]


def _sets(data_dir: str, *extra: str) -> list[str]:
    return [f"data.path={data_dir}", "train.steps=3", "checkpoint.interval=2", "eval.interval=0",
            f"data.seq_len={SEQ}", f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL}", *EP, *extra]


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, data_dir) -> dict:
    root = tmp_path_factory.mktemp("ep2")
    records = train(2, str(root / "out"), _sets(data_dir), ds_config="ds_configs/zero1.json")
    ckpt = root / "out" / "checkpoints"
    return {"records": {r["step"]: r for r in records}, "ckpt": ckpt, "step2": ckpt / "step00000002",
            "step3": ckpt / "step00000003"}


def _export(tag, out) -> dict[str, torch.Tensor]:
    """`export hf` in fp32; returns every tensor of the directory (main model and MTP file)."""
    assert cli(["export", "hf", str(tag), "--out", str(out), "--dtype", "fp32", "--work-dir", str(out.parent)]) == 0
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    return tensors


@pytest.fixture(scope="module")
def exported(ep_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep2_export") / "hf"
    return out, _export(ep_run["step2"], out)


def _deepspeed_expert_tensors(tag) -> dict[str, torch.Tensor]:
    """HF name -> tensor, read from DeepSpeed's own files without deepseek-ds' name mapping: AutoEP's per-expert files
    (layer_<moe id>_expert_<e>_...: w1 = gate, w3 = up, w2 = down of expert e) and its router in the model states.
    A layer's HF prefix is that of our pipeline layer at the module path DeepSpeed records."""
    from deepseek_ds.models.pipeline import layer_specs
    from deepseek_ds.models.presets import build_model_config

    specs = layer_specs(build_model_config(path=str(tag)), seed=None)
    states = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    out = {}
    for info in states["ds_autoep_layers"]:
        path = info["module_path"]  # layers.<spec index>.layer.mlp
        with torch.device("meta"):
            hf = hf_layer_prefix(specs[int(path.split(".")[1])].build()) + "mlp."
        out[hf + "gate.weight"] = states["module"][f"{path}.router.gate.weight"]
        out[hf + "gate.e_score_correction_bias"] = states["module"][f"{path}.router.e_score_correction_bias"]
        for e in range(info["num_experts"]):
            expert = torch.load(tag / f"layer_{info['moe_layer_id']}_expert_{e}_mp_rank_00_model_states.pt",
                                map_location="cpu", weights_only=False)
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"{hf}experts.{e}.{proj}.weight"] = expert[f"{path}.experts.{w}.{e}"]
    return out


def _assert_equal_deepspeed_files(tensors: dict[str, torch.Tensor], tag) -> None:
    reference = _deepspeed_expert_tensors(tag)
    mtp_layer = json.loads((tag / "config.json").read_text())["num_hidden_layers"]
    assert f"model.layers.{mtp_layer}.mlp.experts.7.down_proj.weight" in reference  # the MTP module's MoE too
    assert len(reference) == 4 * (2 + 8 * 3)  # 3 main MoE layers + 1 MTP layer: router, bias, 8 experts x 3
    for name, want in reference.items():
        assert torch.equal(tensors[name], want.float()), name
    biases = [v for k, v in reference.items() if k.endswith("e_score_correction_bias")]
    assert all(b.abs().max() > 0 for b in biases)  # the balancer moved them: a lost bias would show


def test_export_reproduces_the_logged_loss(ep_run, exported, data_dir):
    from transformers import AutoModelForCausalLM

    out, _ = exported
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert abs(training_loss(model, data_dir, 3, SEQ, GLOBAL, MICRO) - ep_run["records"][3]["lm_loss"]) < 1e-5


def test_exported_experts_are_deepspeeds_expert_files_in_expert_order(ep_run, exported):
    """The export reads the optimizer's fp32 partitions (through the universal conversion); DeepSpeed's per-expert
    model files are written from the module. In fp32 training they hold the same values."""
    _, tensors = exported
    _assert_equal_deepspeed_files(tensors, ep_run["step2"])


def test_export_of_zero0_reads_the_expert_files(ep_run, exported, tmp_path):
    """ZeRO-0 has no optimizer shards: the experts come from AutoEP's per-expert files. A ZeRO-1 fp32 checkpoint holds
    the same model files with the same values; relabelled as ZeRO-0 (optimizer files removed) it exports the tensors
    that the universal conversion gave."""
    copy = shutil.copytree(ep_run["step2"], tmp_path / "ckpt" / "step00000002")
    meta = json.loads((copy / checkpoint.META).read_text())
    meta["layout"]["zero_stage"] = 0
    (copy / checkpoint.META).write_text(json.dumps(meta))
    for optim in copy.glob("*optim_states.pt"):
        optim.unlink()
    _, want = exported
    got = _export(copy, tmp_path / "hf")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_eval_model_of_an_expert_parallel_checkpoint_is_the_export(ep_run, exported):
    """`deepseek-ds eval` rebuilds the model without AutoEP: its logits are the HF export's."""
    from transformers import AutoModelForCausalLM

    from deepseek_ds.inference.eval import model_from_checkpoint, run_config_for

    tag = str(ep_run["step2"])
    ours, mcfg = model_from_checkpoint(tag, run_config_for(tag, None, []))
    reference = AutoModelForCausalLM.from_pretrained(exported[0]).eval()
    x = torch.randint(0, mcfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours.eval()(x), reference(input_ids=x).logits, atol=1e-5)


@pytest.mark.parametrize("ranks,ds_config,layout", [(2, "ds_configs/zero2.json", "dp=2 pp=1 ep=2 zero=2 fp32"),
                                                     (4, "ds_configs/zero1.json", "dp=4 pp=1 ep=2 zero=1 fp32")],
                         ids=["zero2", "dp4"])
def test_resume_reshards_through_universal_and_exports(ranks, ds_config, layout, ep_run, data_dir, tmp_path):
    """ZeRO-1 -> ZeRO-2, and 2 -> 4 data-parallel ranks, with the same EP=2: the universal conversion carries AutoEP's
    experts and the router biases (from buffers/); step 3 repeats the run's, and the new checkpoint exports like
    the first."""
    ckpt = fresh_ckpt_dir(ep_run["step2"], tmp_path / "ckpt")
    records = train(ranks, str(tmp_path / "out"), _sets(data_dir, f"checkpoint.dir={ckpt}"), ds_config=ds_config)
    assert losses(records) == pytest.approx({3: ep_run["records"][3]["loss"]}, abs=1e-5)
    assert router_biases(records)[3] == pytest.approx(router_biases(list(ep_run["records"].values()))[3], abs=1e-7)
    assert is_converted(universal_dir(str(ckpt / "step00000002"), "sequential"))
    tag = ckpt / "step00000003"
    assert checkpoint.saved_layout(checkpoint.read_meta(str(tag))).describe() == layout
    assert set(read_buffers(str(tag))) == {f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                                                      for i in (1, 2, 3, 4)}
    _assert_equal_deepspeed_files(_export(tag, tmp_path / "hf"), tag)


def test_resume_without_expert_parallelism_is_refused(ep_run):
    """EP=2 -> EP=1 is not resharding (transformers' MoE block instead of AutoEP's): refused before DeepSpeed loads
    anything, naming the field. A checkpoint whose layout predates the field is read from its run config."""
    tag = str(ep_run["step2"])
    meta = checkpoint.read_meta(tag)
    saved = checkpoint.saved_layout(meta)
    assert saved.expert_parallel == 2
    del meta["layout"]["expert_parallel"]
    assert checkpoint.saved_layout(meta) == saved
    now = dataclasses.replace(saved, expert_parallel=1)
    assert not _loads_natively(saved, now)
    with pytest.raises(checkpoint.CheckpointError, match=r"parallel.expert_parallel = 1 but the checkpoint was "
                                                         r"trained with 2.*set parallel.expert_parallel = 2"):
        _check_reshardable(tag, saved, now, lora_r=0)
