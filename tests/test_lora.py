"""LoRA with peft: training under ZeRO-1, ZeRO-3 and 2 pipeline stages against a single-process transformers + peft
+ torch AdamW reference, the frozen base untouched, optimizer state only for the adapters, small checkpoints that
resume bitwise, and the adapter / merged exports against the toolkit's model; the refusals before launch.

One launch per layout (tests/lora_worker.py: the real set-up and training loop, then what the engine holds); the
ZeRO-1 run also writes the checkpoints the resume and export tests use."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from deepseek_ds.config import load_run_config
from deepseek_ds.models.hf_io import load_hf_weights
from deepseek_ds.models.lora import apply_lora, lora_config
from deepseek_ds.models.names import hf_state_dict
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from helpers import cli, losses, read_metrics, refused, run_ranks
from reference import lora_reference_losses

STEPS = 3
LORA = ["lora.r=4", "lora.alpha=8"]
SETS = [f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64",
        "train.warmup_steps=0", "eval.interval=0", "model.preset=null", *LORA]  # MoE balancing: tiny-v3's defaults
K_FP32_ADAM = 12  # bytes of optimizer state per trainable fp32 parameter: master copy, exp_avg, exp_avg_sq


def _sets(data_dir: str, base_dir: str, *extra: str) -> list[str]:
    return SETS + [f"data.path={data_dir}", f"model.path={base_dir}", *extra]


def _launch(tmp_path_factory, name: str, sets: list[str], ds_config: str, ranks: int = 2,
            checkpoints: str | None = None) -> dict:
    """One run of lora_worker.py: its metrics' losses and every rank's dump."""
    out = tmp_path_factory.mktemp(name) / "out"
    if checkpoints:
        shutil.copytree(checkpoints, out / "checkpoints")
    args = ["tests/lora_worker.py", "--config", "recipes/tiny-v3.yaml", "--deepspeed_config", ds_config]
    for s in sets + [f"train.output_dir={out}"]:
        args += ["--set", s]
    run_ranks(ranks, args)
    ranks_out = [torch.load(out / f"lora_rank{r}.pt", weights_only=True) for r in range(ranks)]
    records = read_metrics(str(out))
    return {"out": out, "losses": losses(records), "ranks": ranks_out,
            "grad_norms": {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}}


@pytest.fixture(scope="module")
def zero1(tmp_path_factory, data_dir, lora_base) -> dict:
    """ZeRO-1 on 2 ranks, 3 steps, checkpoints at 2 and 3."""
    return _launch(tmp_path_factory, "lora_zero1", _sets(data_dir, lora_base, "checkpoint.interval=2", "checkpoint.keep=2"),
                   "ds_configs/zero1.json")


def _merged(dumps: list[dict], key: str) -> dict[str, torch.Tensor]:
    """One rank's tensors of kind `key` per name (pipeline stages hold different ones; replicas equal ones)."""
    out = {}
    for d in dumps:
        for name, t in d[key].items():
            if name in out:
                assert torch.equal(out[name], t), name
            out[name] = t
    return out


@pytest.fixture(scope="module")
def reference(zero1, data_dir, lora_base) -> list[float]:
    cfg = load_run_config("recipes/tiny-v3.yaml", _sets(data_dir, lora_base))
    return lora_reference_losses(cfg, lora_base, data_dir, _merged(zero1["ranks"], "initial"))


def _hf_rows(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """hf[name], or the expert rows `name[first:end]` of it (an AutoEP rank's experts)."""
    base, _, rows = name.partition("[")
    if not rows:
        return hf[name]
    first, end = map(int, rows.rstrip("]").split(":"))
    return hf[base][first:end]


def _check_run(run: dict, reference: list[float], base_dir: str) -> None:
    """Losses equal the reference's; frozen weights are model.path's, bitwise; adapters moved (B starts at 0); each
    rank's optimizer state is K x its trainable parameters / the ranks ZeRO shards over."""
    got = [run["losses"][s] for s in range(1, STEPS + 1)]
    assert max(abs(a - b) for a, b in zip(got, reference)) < 1e-5, (got, reference)
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    frozen = _merged(run["ranks"], "frozen")
    assert frozen and all(torch.equal(t, _hf_rows(hf, name)) for name, t in frozen.items())
    initial, final = _merged(run["ranks"], "initial"), _merged(run["ranks"], "final")
    assert all(not torch.equal(initial[n], final[n]) for n in final if ".lora_B." in n)
    for rank in run["ranks"]:
        dense = rank["trainable"] - rank["expert_trainable"]
        want = K_FP32_ADAM * (dense / rank["zero_ranks"] + rank["expert_trainable"] / rank["expert_zero_ranks"])
        assert abs(rank["optimizer_bytes"] - want) <= K_FP32_ADAM * 64, (rank["optimizer_bytes"], want)
        assert rank["optimizer_bytes"] < 0.1 * K_FP32_ADAM * sum(t.numel() for t in rank["frozen"].values())


@pytest.mark.launch
def test_lora_zero1_equals_transformers_peft_reference(zero1, reference, lora_base):
    assert len(reference) == STEPS
    _check_run(zero1, reference, lora_base)


EXPERTS = ["lora.routed_experts=true"]


@pytest.fixture(scope="module")
def zero3_experts(tmp_path_factory, data_dir, lora_base) -> dict:
    """ZeRO-3, EP=1, adapters on the routed experts too, a checkpoint at the last step; with its transformers + peft
    (target_parameters) + AdamW reference's losses and gradient norms."""
    sets = _sets(data_dir, lora_base, *EXPERTS)
    run = _launch(tmp_path_factory, "lora_zero3", sets + [f"checkpoint.interval={STEPS}"], "ds_configs/zero3.json")
    norms = []
    run["reference"] = lora_reference_losses(load_run_config("recipes/tiny-v3.yaml", sets), lora_base, data_dir,
                                             _merged(run["ranks"], "initial"), norms)
    run["reference_norms"] = norms
    return run


@pytest.mark.launch
def test_lora_zero3_starts_partitioned_and_adapts_the_routed_experts_as_peft(zero3_experts, lora_base, zero1):
    """ZeRO-3 + LoRA builds under deepspeed.zero.Init (each rank holds half the base from the start; rank 0 reads
    each gathered layer, the others read nothing) and, with adapters on the routed experts too, trains as
    transformers + peft (target_parameters) + AdamW."""
    run = zero3_experts
    initial = _merged(run["ranks"], "initial")
    assert any(".mlp.experts." in n for n in initial)
    assert all(torch.equal(t, initial[n]) for n, t in _merged(zero1["ranks"], "initial").items())
    _check_run(run, run["reference"], lora_base)
    total = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(lora_base).parameters())
    for rank in (0, 1):
        log = (run["out"] / "logs" / f"rank{rank}.log").read_text()
        held, whole = map(int, re.search(r"ZeRO-3: built partitioned .*: this rank holds (\d+) of (\d+) parameter "
                                         r"elements", log).groups())
        assert whole == total and held < 0.51 * total, (held, whole, total)
        read = float(re.search(r"loaded ([\d.]+) MB of weights", log).group(1))
        assert (read > 0) if rank == 0 else (read == 0)


@pytest.fixture(scope="module")
def autoep_zero1(tmp_path_factory, data_dir, lora_base) -> dict:
    """EP=2 on 2 ranks (each holds half the experts and their adapters), ZeRO-1, checkpoints at 2 and 3."""
    return _launch(tmp_path_factory, "lora_ep2_zero1", _sets(data_dir, lora_base, *EXPERTS, "parallel.expert_parallel=2",
                                                             "checkpoint.interval=2", "checkpoint.keep=2"),
                   "ds_configs/zero1.json")


@pytest.mark.launch
@pytest.mark.parametrize("stage", [1, 2])
def test_lora_on_autoep_experts_equals_one_process(stage, autoep_zero1, zero3_experts, tmp_path_factory, data_dir,
                                                   lora_base):
    """Adapters on the routed experts under AutoEP (parallel/expert_lora.py): the same initial adapters as EP=1,
    and the reference's losses and gradient norms; frozen experts bitwise the base's rows; each rank's optimizer
    holds its dense adapters' share over the data-parallel ranks and its own experts' adapters."""
    run = autoep_zero1 if stage == 1 else _launch(
        tmp_path_factory, "lora_ep2_zero2", _sets(data_dir, lora_base, *EXPERTS, "parallel.expert_parallel=2"),
        "ds_configs/zero2.json")
    assert _merged(run["ranks"], "initial").keys() == _merged(zero3_experts["ranks"], "initial").keys()
    assert all(torch.equal(t, _merged(zero3_experts["ranks"], "initial")[n])
               for n, t in _merged(run["ranks"], "initial").items())
    _check_run(run, zero3_experts["reference"], lora_base)
    assert [run["grad_norms"][s] for s in range(1, STEPS + 1)] == pytest.approx(zero3_experts["reference_norms"],
                                                                               rel=1e-5)
    assert all(rank["expert_trainable"] > 0 for rank in run["ranks"])


@pytest.mark.launch
def test_lora_on_autoep_experts_with_a_pipeline_equals_one_process_and_exports_as_ep1(
        zero3_experts, tmp_path_factory, tmp_path, data_dir, lora_base):
    """PP=2 x DP=2 x EP=2 on 4 ranks: each stage's EP ranks hold their experts' adapters; the reference's losses and
    grad norms, and an export equal to EP=1's."""
    run = _launch(tmp_path_factory, "lora_pp2xep2", _sets(data_dir, lora_base, *EXPERTS, "parallel.expert_parallel=2",
                                                          "parallel.pipeline_stages=2", f"checkpoint.interval={STEPS}"),
                  "ds_configs/zero1_pp.json", ranks=4)
    assert all(torch.equal(t, _merged(zero3_experts["ranks"], "initial")[n])
               for n, t in _merged(run["ranks"], "initial").items())
    _check_run(run, zero3_experts["reference"], lora_base)
    assert [run["grad_norms"][s] for s in range(1, STEPS + 1)] == pytest.approx(zero3_experts["reference_norms"],
                                                                               rel=1e-5)
    assert len(os.listdir(run["out"] / "checkpoints" / f"step{STEPS:08d}" / "expert_adapters")) == 4  # stage x EP rank
    ids = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(5))
    logits = []
    for name, ckpt in (("pp2xep2", run["out"] / "checkpoints"), ("ep1", zero3_experts["out"] / "checkpoints")):
        assert cli(["export", "lora", str(ckpt), "--out", str(tmp_path / name)]) == 0
        with torch.no_grad():
            peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lora_base), str(tmp_path / name))
            logits.append(peft.eval()(input_ids=ids).logits)
    assert (logits[0] - logits[1]).abs().max() < 1e-5


@pytest.mark.launch
def test_attention_only_lora_on_autoep_equals_the_reference(tmp_path_factory, data_dir, lora_base, reference):
    """Every expert frozen under AutoEP (DeepSpeed's ZeRO optimizer asserted an expert parameter group before)."""
    run = _launch(tmp_path_factory, "lora_ep2_attention", _sets(data_dir, lora_base, "parallel.expert_parallel=2"),
                  "ds_configs/zero1.json")
    _check_run(run, reference, lora_base)
    assert all(rank["expert_trainable"] == 0 for rank in run["ranks"])


@pytest.mark.launch
def test_autoep_lora_checkpoint_resumes_bitwise_and_exports_as_ep1(autoep_zero1, zero3_experts, tmp_path_factory,
                                                                   data_dir, lora_base, tmp_path):
    """Each expert-parallel rank's adapters are its own in the checkpoint: resuming step 2 gives step 3 bitwise;
    `export lora` gathers every rank's experts into one peft directory that gives EP=1's exported logits, and
    `export hf` merges them."""
    step2 = autoep_zero1["out"] / "checkpoints" / "step00000002"
    assert sorted(os.listdir(step2 / "expert_adapters")) == ["ep_rank_000.pt", "ep_rank_001.pt"]
    # DeepSpeed's per-expert files are markers (the frozen experts come from model.path): the adapters are the bulk
    expert_files = list(step2.glob("layer_*_expert_*_model_states.pt"))
    assert expert_files and all(f.stat().st_size < 2048 for f in expert_files)
    size = sum(f.stat().st_size for f in step2.rglob("*") if f.is_file())
    assert size < 0.25 * sum(f.stat().st_size for f in os.scandir(lora_base) if f.name.endswith(".safetensors"))
    keep = tmp_path_factory.mktemp("lora_ep2_resume_src") / "checkpoints"
    keep.mkdir()
    shutil.copytree(step2, keep / step2.name)
    (keep / "latest").write_text(step2.name)
    resumed = _launch(tmp_path_factory, "lora_ep2_resume", _sets(data_dir, lora_base, *EXPERTS,
                                                                 "parallel.expert_parallel=2"),
                      "ds_configs/zero1.json", checkpoints=str(keep))
    assert resumed["losses"][3] == autoep_zero1["losses"][3]
    final, again = _merged(autoep_zero1["ranks"], "final"), _merged(resumed["ranks"], "final")
    assert all(torch.equal(final[n], again[n]) for n in final)
    ids = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(5))
    logits = {}
    for name, ckpt in (("ep2", autoep_zero1["out"] / "checkpoints"), ("ep1", zero3_experts["out"] / "checkpoints")):
        assert cli(["export", "lora", str(ckpt), "--out", str(tmp_path / name)]) == 0
        with torch.no_grad():
            peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lora_base), str(tmp_path / name))
            logits[name] = peft.eval()(input_ids=ids).logits
    assert (logits["ep2"] - logits["ep1"]).abs().max() < 1e-5
    assert cli(["export", "hf", str(autoep_zero1["out"] / "checkpoints"), "--out", str(tmp_path / "merged"),
                "--dtype", "fp32"]) == 0
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(lora_base).eval()(input_ids=ids).logits
    assert (merged - logits["ep2"]).abs().max() < 1e-5
    assert (plain - logits["ep2"]).abs().max() > 1e-4  # the adapters change the model


@pytest.mark.launch
@pytest.mark.parametrize("layout", ["pp2", "sp2"])
def test_lora_pipeline_and_sequence_parallel_equal_the_reference(layout, tmp_path_factory, data_dir, lora_base,
                                                                  zero1, reference):
    ds, extra = {"pp2": ("ds_configs/zero1_pp.json", ["parallel.pipeline_stages=2"]),
                 "sp2": ("ds_configs/zero1.json", ["parallel.sequence_parallel=2"])}[layout]
    run = _launch(tmp_path_factory, f"lora_{layout}", _sets(data_dir, lora_base, *extra), ds)
    # The same initial adapters whatever the layout: each is seeded by its own HF name.
    assert all(torch.equal(t, _merged(zero1["ranks"], "initial")[n]) for n, t in _merged(run["ranks"], "initial").items())
    _check_run(run, reference, lora_base)


@pytest.mark.launch
def test_lora_checkpoint_holds_only_adapters_and_resumes_bitwise(tmp_path_factory, zero1, data_dir, lora_base):
    """The step directory is small (no frozen base in any file); resuming step 2 gives step 3 bitwise."""
    step2 = zero1["out"] / "checkpoints" / "step00000002"
    size = sum(f.stat().st_size for f in step2.rglob("*") if f.is_file())
    base_bytes = sum(f.stat().st_size for f in os.scandir(lora_base) if f.name.endswith(".safetensors"))
    assert size < 0.25 * base_bytes, (size, base_bytes)
    states = torch.load(step2 / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert states and all(".lora_" in k or k.endswith("e_score_correction_bias") for k in states)
    keep = tmp_path_factory.mktemp("lora_resume_src") / "checkpoints"
    keep.mkdir()
    shutil.copytree(step2, keep / step2.name)
    (keep / "latest").write_text(step2.name)
    resumed = _launch(tmp_path_factory, "lora_resume", _sets(data_dir, lora_base), "ds_configs/zero1.json",
                      checkpoints=str(keep))
    assert resumed["losses"][3] == zero1["losses"][3]
    final, again = _merged(zero1["ranks"], "final"), _merged(resumed["ranks"], "final")
    assert all(torch.equal(final[n], again[n]) for n in final)


def _trainable(layers) -> dict[str, torch.Tensor]:
    """HF name -> trainable parameter of our layers, through the one name map that loading and export use."""
    return {name: p for name, p in hf_state_dict(layers, keep_vars=True).items() if p.requires_grad}


def _toolkit_logits(base_dir: str, adapters: dict[str, torch.Tensor], section, ids: torch.Tensor,
                    tag_dir) -> torch.Tensor:
    """Our own model: the pipeline layers in one process, the base from base_dir, the router biases training moved
    (the checkpoint's buffers), peft's adapters holding `adapters`."""
    from deepseek_ds.checkpoint.state import read_buffers

    mcfg = prepare_config(build_model_config(path=base_dir))
    model = build_model(mcfg, 1, 0)
    load_hf_weights(local_layers(model), base_dir, mcfg)
    state = hf_state_dict(local_layers(model))
    with torch.no_grad():
        for name, t in read_buffers(str(tag_dir)).items():
            state[name].copy_(t)
    apply_lora(model, section, mcfg, 0)
    mine = _trainable(local_layers(model))
    assert set(mine) == set(adapters)
    with torch.no_grad():
        for name, t in adapters.items():
            mine[name].copy_(t)
        return model.eval()(ids)


@pytest.mark.launch
def test_exported_adapter_and_merged_model_give_the_toolkit_logits(tmp_path, zero1, data_dir, lora_base):
    from peft import PeftModel

    from deepseek_ds.inference.generate import load_model

    ckpt = zero1["out"] / "checkpoints"
    assert cli(["export", "lora", str(ckpt), "--out", str(tmp_path / "adapter")]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    assert cli(["export", "hf", str(ckpt), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    cfg = load_run_config("recipes/tiny-v3.yaml", _sets(data_dir, lora_base))
    ids = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(5))
    want = _toolkit_logits(lora_base, _merged(zero1["ranks"], "final"), cfg.lora, ids, ckpt / f"step{STEPS:08d}")
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lora_base), str(tmp_path / "adapter")).eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        plain = AutoModelForCausalLM.from_pretrained(lora_base).eval()
        assert (peft(input_ids=ids).logits - want).abs().max() < 1e-5
        assert (merged(input_ids=ids).logits - want).abs().max() < 1e-5
        assert (plain(input_ids=ids).logits - want).abs().max() > 1e-4  # the adapters change the model
        for source in (tmp_path / "adapter", ckpt):  # what generate and eval --task load
            model, _ = load_model(str(source))
            assert (model(input_ids=ids).logits - want).abs().max() < 1e-5


@pytest.mark.unit
def test_lora_refusals_name_the_reason_and_the_fix(data_dir, tmp_path):
    from deepseek_ds.config import load_ds_config

    ds = load_ds_config("ds_configs/zero1.json")
    cfg = load_run_config("recipes/tiny-v3.yaml", [f"data.path={data_dir}", "lora.r=4"])
    assert refused(cfg, ds, world=2, match="lora.r > 0 adapts a pretrained model.*set model.path")
    cfg = load_run_config("recipes/tiny-v3.yaml", [f"data.path={data_dir}", "lora.r=4", "parallel.expert_parallel=2"])
    assert refused(cfg, load_ds_config("ds_configs/zero3.json"), world=2,
                   match="expert_parallel > 1 and ZeRO-3: DeepSpeed cannot checkpoint frozen AutoEP experts")
    cfg = load_run_config("recipes/tiny-v3.yaml", [f"data.path={data_dir}", "lora.r=4",
                                                   "lora.target_modules=[o_proj,shared_experts.up_proj]"])
    assert refused(cfg, ds, world=2, match=r"\['up_proj'\] on a DeepSeek model: peft .* maps these names to the fused")
    cfg = load_run_config("recipes/tiny-dense.yaml", [f"data.path={data_dir}", "lora.r=4", "lora.routed_experts=true"])
    assert refused(cfg, ds, world=2, match="no routed experts")


@pytest.mark.unit
def test_routed_expert_adapters_have_the_names_and_logits_of_peft_on_transformers(tmp_path):
    """lora.routed_experts: peft's adapters on the fused experts of our layers carry the names and compute the
    logits of the same LoraConfig that peft applies to the transformers model (what export and PeftModel use)."""
    from peft import get_peft_model

    from deepseek_ds.config.schema import LoraSection
    from deepseek_ds.models.hf_io import to_hf_model

    section = LoraSection(r=2, alpha=4.0, routed_experts=True, modules_to_save=["lm_head"])
    mcfg = prepare_config(build_model_config("tiny-v3"))
    ours = build_model(mcfg, 1, 7)
    hf = get_peft_model(to_hf_model(local_layers(build_model(mcfg, 1, 7)), mcfg),
                        lora_config(section, mcfg, modules_to_save=True))
    apply_lora(ours, section, mcfg, 7)
    mine = _trainable(local_layers(ours))
    assert any(".mlp.experts." in n for n in mine) and "lm_head.weight" in mine
    theirs = {n.removeprefix("base_model.model.").replace(".modules_to_save.default", ""): p
              for n, p in hf.named_parameters() if p.requires_grad}
    assert set(mine) == set(theirs)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in mine.items():  # B != 0, so that every adapter changes the logits
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            theirs[name].copy_(p)
        ids = torch.randint(0, mcfg.vocab_size, (2, 17), generator=gen)
        want = ours.eval()(ids)
        assert (want - hf.eval()(input_ids=ids).logits).abs().max() < 1e-5
        # eval.task during training: transformers' model sharing our layers' tensors, adapters included
        assert (want - to_hf_model(local_layers(ours), mcfg, section)(input_ids=ids).logits).abs().max() < 1e-5
