"""The run config, the DeepSpeed JSON files and validate(): one test per refusal rule."""

import glob
import json
import os
import re

import pytest
import yaml

from deepseek_ds.config import (
    PROJECT_ROOT,
    RESOLVED_NAME,
    CheckpointSection,
    ConfigError,
    DataSection,
    ModelSection,
    ParallelSection,
    TrainSection,
    apply_overrides,
    load_and_validate,
    load_ds_config,
    load_run_config,
    resolve_ds_config,
    run_config_from_dict,
    validate,
    write_resolved,
)
from deepseek_ds.training.main import main as train_main
from helpers import refused

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DS = os.path.join(ROOT, "ds_configs")


def cfg(**sections):
    return run_config_from_dict(sections)


def ds(name="zero1.json"):
    return load_ds_config(os.path.join(DS, name))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(DS, "*.json"))), ids=os.path.basename)
def test_every_ds_config_resolves_and_passes_deepspeed_own_validation(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = load_ds_config(path)
    pp = 2 if raw.get("pipeline") else 1
    clip = 0.7
    c = cfg(parallel={"pipeline_stages": pp}, train={"micro_batch_size": 2, "global_batch_size": 8, "grad_clip": clip})
    validate(c, raw, world_size=4, cuda_available=True)
    resolved = resolve_ds_config(raw, c, world_size=4)
    assert "auto" not in json.dumps(resolved)
    assert resolved["train_batch_size"] == 8
    assert resolved["gradient_accumulation_steps"] * 2 * (4 // pp) == 8
    assert resolved["optimizer"]["params"]["lr"] == c.train.lr
    # exactly, not approximately: a clip off by 1% is caught by the equivalence tests only when a step's norm exceeds it
    assert resolved["gradient_clipping"] == c.train.grad_clip
    # DeepSpeed's own parser accepts the file as resolved (this process is a world of one rank).
    one = cfg(train={"micro_batch_size": 2, "global_batch_size": 8, "grad_clip": clip})
    single = resolve_ds_config(raw, one, world_size=1)
    single.pop("pipeline", None)
    dsc = DeepSpeedConfig(single, mpu=None)
    assert dsc.train_batch_size == 8 and dsc.gradient_accumulation_steps == 4
    assert dsc.zero_optimization_stage == raw["zero_optimization"]["stage"]
    assert dsc.gradient_clipping == c.train.grad_clip


def test_recipes_load_and_validate(tmp_path):
    """CPU-sized recipes validate on 2 ranks; cluster recipes validate at their cluster size on GPUs,
    except for the local model/data paths that exist only there."""
    for path in sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml"))):
        cpu_sized = "tiny" in os.path.basename(path)
        c = load_run_config(path)
        ds = load_ds_config(os.path.join(ROOT, c.deepspeed_config))
        if c.model.preset and cpu_sized:
            validate(c, ds, world_size=2, cuda_available=False)
            continue
        if cpu_sized:  # sft-tiny-v3: scripts/sft_demo.sh makes its inputs (and its launch test validates them)
            c = load_run_config(path, [f"{key}={tmp_path / 'missing'}" for key in ("model.path", "data.path",
                                                                                   "eval.task")])
        world = 2 if cpu_sized else c.parallel.pipeline_stages * 16
        with pytest.raises(ConfigError) as e:
            validate(c, ds, world_size=world, cuda_available=not cpu_sized)
        problems = [p for p in str(e.value).splitlines()[1:]]
        assert problems and all("does not exist" in p for p in problems), (path, problems)


def test_overrides_parse_yaml_values():
    d = apply_overrides({"train": {"lr": 1.0}}, ["train.lr=3e-4", "train.shuffle=false", "parallel.pipeline_stages=2"])
    c = run_config_from_dict(d)
    assert c.train.lr == pytest.approx(3e-4) and c.train.shuffle is False and c.parallel.pipeline_stages == 2


def test_unknown_key_is_refused_with_suggestion():
    with pytest.raises(ConfigError, match=r"train\.global_batch_szie.*Did you mean 'global_batch_size'"):
        cfg(train={"global_batch_szie": 32})
    with pytest.raises(ConfigError, match=r"unknown key 'trian'.*'train'"):
        run_config_from_dict({"trian": {}})


def test_wrong_type_is_refused():
    with pytest.raises(ConfigError, match=r"train\.steps"):
        cfg(train={"steps": "many"})


def test_batch_arithmetic():
    assert refused(cfg(train={"micro_batch_size": 4, "global_batch_size": 10}), ds(), 2,
            r"global_batch_size \(10\).*micro_batch_size \(4\).*data_parallel \(2")


def test_world_not_divisible_by_pipeline():
    assert refused(cfg(parallel={"pipeline_stages": 2}), ds("zero1_pp.json"), 3, r"world size 3 is not divisible")


def test_pipeline_with_zero2_and_zero3():
    for name in ("zero2.json", "zero3.json"):
        assert refused(cfg(parallel={"pipeline_stages": 2}), ds(name), 2, r"cannot be combined with ZeRO stage [23]")


def test_fp16_without_cuda():
    assert refused(cfg(), ds("zero1_fp16.json"), 2, r"fp16 needs a CUDA GPU", cuda=False)
    validate(cfg(), ds("zero1_fp16.json"), 2, cuda_available=True)


def test_bf16_with_zero0():
    d = ds("zero0.json")
    d["bf16"] = {"enabled": True}
    assert refused(cfg(), d, 2, r"bf16 with ZeRO stage 0.*ZeRO >= 1")


def test_bf16_loss_scale_field():
    d = ds("zero1_bf16.json")
    d["bf16"]["loss_scale"] = 0
    assert refused(cfg(), d, 2, r"bf16.loss_scale")


def test_more_stages_than_layers():
    c = cfg(model={"preset": "tiny-v3"}, parallel={"pipeline_stages": 8}, train={"micro_batch_size": 1, "global_batch_size": 1})
    assert refused(c, ds("zero1_pp.json"), 8, r"pipeline_stages \(8\) exceeds the number of pipeline layers \(7")


def test_experts_not_divisible_by_expert_parallel():
    c = cfg(model={"preset": "tiny-v3", "overrides": {"n_routed_experts": 6, "n_group": 3, "topk_group": 1}},
            parallel={"expert_parallel": 4}, train={"micro_batch_size": 1, "global_batch_size": 4})
    assert refused(c, ds(), 4, r"routed experts \(6\) are not divisible by parallel.expert_parallel \(4\)")


def test_expert_parallel_on_dense_model():
    assert refused(cfg(model={"preset": "tiny-dense"}, parallel={"expert_parallel": 2}), ds(), 2, r"dense")


def with_zero(name: str, **keys) -> dict:
    raw = ds(name)
    raw["zero_optimization"].update(keys)
    return raw


@pytest.mark.parametrize("name,key", [("zero1.json", "contiguous_gradients"), ("zero2.json", "contiguous_gradients"),
                                      ("zero1_pp.json", "contiguous_gradients"), ("zero1.json", "reduce_scatter"),
                                      ("zero2.json", "reduce_scatter")])
def test_expert_parallel_needs_deepspeeds_contiguous_reduce_scatter_gradient_path(name, key):
    # ZeRO-1 without contiguous gradients trains EP wrong with only a warning; the others assert on every rank.
    pp = 2 if ds(name).get("pipeline") else 1
    batch = {"micro_batch_size": 1, "global_batch_size": 4}
    c = cfg(parallel={"expert_parallel": 2, "pipeline_stages": pp}, train=batch)
    message = refused(c, with_zero(name, **{key: False}), 4, rf"zero_optimization\.{key} = false with "
                      r"parallel\.expert_parallel > 1 and ZeRO stage [12]")
    assert message.count("zero_optimization.") == 1
    validate(c, with_zero(name, **{key: True}), 4)  # said explicitly, as DeepSpeed's default
    # Without EP, under ZeRO-3, or with the optimizer offloaded (DeepSpeed then forces contiguous gradients), allowed.
    validate(cfg(parallel={"pipeline_stages": pp}, train=batch), with_zero(name, **{key: False}), 4)
    validate(cfg(parallel={"expert_parallel": 2}, train=batch), with_zero("zero3.json", **{key: False}), 4)
    if key == "contiguous_gradients":
        validate(c, with_zero(name, contiguous_gradients=False, offload_optimizer={"device": "cpu"}), 4)


def test_missing_paths():
    assert refused(cfg(data={"path": "/nonexistent/data"}), ds(), 2, r"data.path '/nonexistent/data' does not exist")
    assert refused(cfg(model={"path": "/nonexistent/model", "preset": None}), ds(), 2, r"model.path '/nonexistent/model' does not exist")
    with pytest.raises(ConfigError, match=r"deepspeed_config .* does not exist"):
        load_ds_config("/nonexistent.json")


def test_eval_task_refusals(tmp_path):
    task = tmp_path / "heldout.jsonl"
    task.write_text('{"prompt": "a", "response": "b"}\n')
    ok = {"task": str(task), "interval": 10}
    validate(cfg(eval=ok), ds(), 2)
    assert refused(cfg(eval=ok, parallel={"pipeline_stages": 2}), ds("zero1_pp.json"), 4,
                   r"eval.task needs the whole model on every rank.*pipeline_stages = 2")
    assert refused(cfg(eval=ok, parallel={"expert_parallel": 2}), ds(), 2,
                   r"eval.task needs the whole model.*expert_parallel = 2")
    # AutoTP's shards are not the whole matrices a transformers view needs.
    assert refused(cfg(eval=ok, parallel={"tensor_parallel": 2}), ds(), 2,
                   r"eval.task needs the whole model.*tensor_parallel = 2")
    assert refused(cfg(eval={**ok, "interval": 0}), ds(), 2, r"eval.task .* is never scored with eval.interval 0")
    assert refused(cfg(eval={**ok, "task": str(tmp_path / "nope.jsonl")}), ds(), 2,
                   r"eval.task '.*nope.jsonl' does not exist")


def test_sft_v2_lite_recipe_fits_8_gpus_of_80gb_on_the_meta_device(tmp_path):
    """The real-shape SFT recipe, its model.path a directory holding V2-Lite's released config.json: validate()
    at 8 ranks on GPUs finds only the dataset missing (prepared on the cluster), and the model built on the meta
    device has V2-Lite's published 15.7B parameters, whose ZeRO-3 share (16 bytes each / 8 ranks) fits 80 GB."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from deepseek_ds.models.presets import build_model_config

    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "deepseek-v2-lite-config.json"), tmp_path / "config.json")
    task = tmp_path / "heldout.jsonl"
    task.write_text('{"prompt": "a", "response": "b"}\n')
    c = load_run_config(os.path.join(ROOT, "recipes", "sft-deepseek-v2-lite.yaml"),
                        overrides=[f"model.path={tmp_path}", f"eval.task={task}"])
    d = load_ds_config(os.path.join(ROOT, c.deepspeed_config))
    problems = refused(c, d, 8, cuda=True).splitlines()[1:]
    assert len(problems) == 1 and "data/sft-v2-lite' does not exist" in problems[0], problems
    assert d["zero_optimization"]["stage"] == 3 and d["bf16"]["enabled"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_model_config(path=str(tmp_path)))
    params = sum(p.numel() for p in model.parameters())
    assert abs(params / 1e9 - 15.7) < 0.1, params
    per_rank_gb = 16 * params / 8 / 1e9  # ZeRO-3, bf16 weights and grads + fp32 master and Adam moments
    assert per_rank_gb < 0.5 * 80, per_rank_gb


def test_unknown_preset():
    assert refused(cfg(model={"preset": "tiny-v9"}), ds(), 2, r"unknown preset 'tiny-v9'")


def test_explicit_ds_value_contradicting_run_config():
    d = ds()
    d["train_batch_size"] = 64
    with pytest.raises(ConfigError, match=r"train_batch_size' = 64 contradicts .*train.global_batch_size = 16"):
        resolve_ds_config(d, cfg(), 2)


def test_all_problems_reported_at_once():
    c = cfg(parallel={"pipeline_stages": 2}, train={"micro_batch_size": 3, "global_batch_size": 4})
    with pytest.raises(ConfigError) as e:
        validate(c, ds("zero3.json"), 2, cuda_available=False)
    assert "global_batch_size" in str(e.value) and "ZeRO stage 3" in str(e.value)


def test_single_field_rules_refuse_when_the_section_is_built():
    for build, message in [(lambda: TrainSection(steps=0), "train.steps must be >= 1"),
                           (lambda: TrainSection(nan_policy="ignore"), "train.nan_policy = 'ignore'"),
                           (lambda: TrainSection(resume_schedule="restart"), "train.resume_schedule = 'restart'"),
                           (lambda: TrainSection(log_interval=0), "train.log_interval must be >= 1"),
                           (lambda: ParallelSection(pipeline_stages=0), "parallel.pipeline_stages must be >= 1"),
                           (lambda: DataSection(seq_len=1), "data.seq_len must be >= 2"),
                           (lambda: DataSection(builtin="wiki"), "only built-in corpus is 'stdlib'"),
                           (lambda: CheckpointSection(keep=0), "checkpoint.keep must be >= 1"),
                           (lambda: ModelSection(preset=None), "set model.preset")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            build()
    with pytest.raises(ConfigError, match=r"train.steps must be >= 1\ntrain.micro_batch_size must be >= 1"):
        cfg(train={"steps": 0, "micro_batch_size": 0})  # a section reports all its problems at once


def test_values_are_checked_against_the_field_types():
    c = cfg(train={"lr": "3e-4", "min_lr": 0, "peak_tflops": None}, model={"overrides": {"n_group": 2}})
    assert c.train.lr == pytest.approx(3e-4) and isinstance(c.train.min_lr, float) and c.train.peak_tflops is None
    assert c.model.overrides == {"n_group": 2}
    with pytest.raises(ConfigError, match=r"train.steps = True has the wrong type: expected int"):
        cfg(train={"steps": True})
    with pytest.raises(ConfigError, match=r"train.lr must not be null"):
        cfg(train={"lr": None})
    with pytest.raises(ConfigError, match=r"model.overrides = 3 has the wrong type: expected dict"):
        cfg(model={"overrides": 3})


def test_data_parallel_size_and_grad_accum_have_one_home():
    c = cfg(parallel={"pipeline_stages": 2}, train={"micro_batch_size": 2, "global_batch_size": 16})
    assert c.data_parallel_size(8) == 4 and c.grad_accum_steps(4) == 2
    assert resolve_ds_config(ds("zero1_pp.json"), c, 8)["gradient_accumulation_steps"] == 2


def test_malformed_yaml_is_one_line_naming_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 5\n  lr: [1e-3, 2e-3\nmodel:\n  preset: tiny-v3\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(str(bad))
    assert re.match(rf"{re.escape(str(bad))}:\d+:\d+: not valid YAML: ", str(e.value)), str(e.value)
    assert "\n" not in str(e.value)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list.yaml: a run YAML is a mapping"):
        load_run_config(str(tmp_path / "list.yaml"))


def test_nested_deepspeed_typo_is_refused_naming_the_key():
    d = ds("zero3.json")
    d["zero_optimization"]["stage3_prefetch_bucket_sise"] = 5e7
    message = refused(cfg(), d, 2, r"'zero_optimization\.stage3_prefetch_bucket_sise': Extra inputs are not permitted")
    assert "did you mean 'stage3_prefetch_bucket_size'" in message
    assert len(message.splitlines()) == 2  # the header and one line for the one problem
    d = ds("zero1.json")
    d["zero_optimization"]["reduce_bucket_size"] = "big"
    refused(cfg(), d, 2, r"'zero_optimization\.reduce_bucket_size'")


def test_recipe_paths_do_not_depend_on_the_current_directory(tmp_path, monkeypatch):
    """Relative inputs in a recipe inside the project resolve against the project root, in a recipe elsewhere
    against the recipe's directory; command-line paths stay relative to the current directory."""
    monkeypatch.chdir(tmp_path)
    c, resolved = load_and_validate(os.path.join(ROOT, "recipes", "tiny-v3.yaml"), world_size=2, cuda_available=False)
    assert c.deepspeed_config == os.path.join(PROJECT_ROOT, "ds_configs", "zero1.json") and resolved["train_batch_size"]
    assert load_run_config(None).deepspeed_config == os.path.join(PROJECT_ROOT, "ds_configs", "zero1.json")

    own = tmp_path / "elsewhere"
    (own / "corpus").mkdir(parents=True)
    (own / "mine.json").write_text(json.dumps(ds("zero1.json")))
    (own / "run.yaml").write_text("deepspeed_config: mine.json\ndata:\n  path: corpus\ntrain:\n  output_dir: out\n"
                                  "eval:\n  task: heldout.jsonl\n")
    c = load_run_config(str(own / "run.yaml"))
    assert (c.deepspeed_config, c.data.path, c.eval.task) == (str(own / "mine.json"), str(own / "corpus"),
                                                              str(own / "heldout.jsonl"))
    assert c.train.output_dir == "out"  # outputs: relative to the current directory
    assert load_run_config(str(own / "run.yaml"), ["data.path=here"]).data.path == "here"


def test_resolved_config_is_written_only_for_an_accepted_run(tmp_path, monkeypatch):
    c, d = load_and_validate("recipes/tiny-v3.yaml", sets=[f"train.output_dir={tmp_path}"], world_size=2)
    doc = yaml.safe_load(open(write_resolved(c, d, 2)))
    assert doc["run"]["train"]["output_dir"] == str(tmp_path) and doc["deepspeed"] == d and doc["world_size"] == 2
    assert set(doc["versions"]) == {"python", "torch", "deepspeed", "transformers"}
    (tmp_path / RESOLVED_NAME).write_text("the earlier run\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_main(["--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={tmp_path}",
                       "--set", "train.global_batch_size=10"]) == 2
    assert (tmp_path / RESOLVED_NAME).read_text() == "the earlier run\n"


def test_the_model_config_is_built_once_for_every_check_and_the_run(monkeypatch):
    """validate's rules (sequence and tensor parallelism, the model's own, the vocabulary), the DeepSpeed JSON's
    AutoTP section and the run all read cfg.model.hf_config: one transformers config per process, with the kernel
    choices set. The check can fail: each rule built its own before."""
    from deepseek_ds.models.presets import PRESETS

    built, config_cls = [], PRESETS["tiny-v3"].config_cls
    real = config_cls.__init__
    # A model's config has its fields given; presets' check of override names builds one of the class's defaults.
    monkeypatch.setattr(config_cls, "__init__", lambda self, **kw: kw and built.append(kw) or real(self, **kw))
    c = cfg(model={"preset": "tiny-v3", "attn_implementation": "eager"},
            parallel={"tensor_parallel": 2, "sequence_parallel": 1},
            train={"micro_batch_size": 1, "global_batch_size": 2})
    validate(c, ds(), 2, cuda_available=False, files=False)
    validate(c, ds(), 2, cuda_available=False, files=False)
    assert "tensor_parallel" in resolve_ds_config(ds(), c, 2)
    assert len(built) == 1 and built[0]["num_hidden_layers"] == PRESETS["tiny-v3"].fields["num_hidden_layers"]
    assert c.model.hf_config is c.model.hf_config and c.model.hf_config._attn_implementation == "eager"
