"""The run configuration: typed sections loaded from YAML with `--set section.key=value` overrides, the
DeepSpeed JSON with its "auto" values filled from it, and ONE validate() that checks both and the world
size together before any work starts."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the fix."""


@dataclass
class ModelSection:
    preset: str | None = "tiny-v3"
    path: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # transformers config fields, e.g. num_hidden_layers
    attn_implementation: str = "sdpa"
    experts_implementation: str = "grouped_mm"
    activation_checkpoint_interval: int = 0
    partition_method: str = "balanced"


@dataclass
class DataSection:
    path: str | None = None
    builtin: str | None = "stdlib"
    builtin_max_mb: float = 8.0
    cache_dir: str = "data_cache"
    seq_len: int = 128


@dataclass
class TrainSection:
    steps: int = 300
    seed: int = 1234
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    global_batch_size: int = 16
    shuffle: bool = True
    output_dir: str = "runs/default"
    dist_timeout_s: int = 1800  # collectives waiting longer than this fail (a dead host ends the job)
    nan_policy: str = "stop"            # non-finite loss: "skip" the step, or "stop" (save, then end the run)
    peak_tflops: float | None = None    # per-device peak for MFU; default: the known GPU's bf16 dense peak
    # lambda of DeepSeek-V3's multi-token-prediction loss (0.3, later 0.1, in its training); the depth is the
    # model's num_nextn_predict_layers (model.overrides), 0 in the tiny presets and 1 in deepseek-v3.
    mtp_loss_weight: float = 0.3


@dataclass
class ParallelSection:
    pipeline_stages: int = 1
    expert_parallel: int = 1
    tensor_parallel: int = 1


@dataclass
class CheckpointSection:
    dir: str | None = None  # default: <train.output_dir>/checkpoints
    interval: int = 0       # 0: only at the end
    keep: int = 2


@dataclass
class EvalSection:
    interval: int = 0
    batches: int = 4


@dataclass
class MoESection:
    """DeepSeekMoE load balancing (models/moe.py). null: the model family's published value (DeepSeek-V3: bias
    update speed 0.001, sequence-wise loss 1e-4; DeepSeek-V2: expert-level loss 0.003, device-level loss 0.05,
    communication loss 0.02; the last two only for models with more than one expert group)."""
    bias_update_speed: float | None = None  # gamma of V3's auxiliary-loss-free balancing; 0: off
    seq_aux_alpha: float | None = None      # sequence-wise (V3) = expert-level (V2) balance loss factor; 0: off
    device_aux_alpha: float | None = None   # V2 device-level balance loss over the model's n_group groups; 0: off
    comm_aux_alpha: float | None = None     # V2 communication balance loss (tokens sent to each group); 0: off


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    moe: MoESection = field(default_factory=MoESection)
    deepspeed_config: str = "ds_configs/zero1.json"

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.train.output_dir, "checkpoints")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ loading
def _unknown_key(where: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else f" Known keys: {', '.join(known)}."
    return ConfigError(f"unknown key '{where}{key}' in the run config.{hint}")


def _coerce(where: str, value: Any, typ: Any) -> Any:
    """Check a YAML value against the dataclass field type (ints are accepted for floats)."""
    allowed = {"int": int, "float": (int, float), "bool": bool, "str": str}
    if isinstance(typ, str):
        parts = [p.strip() for p in typ.split("|")]
        if value is None:
            if "None" in parts:
                return None
            raise ConfigError(f"{where} must not be null")
        for p in parts:
            if p in allowed and isinstance(value, allowed[p]) and not (p != "bool" and isinstance(value, bool)):
                return float(value) if p == "float" else value
            if p == "float" and isinstance(value, str):
                try:  # YAML 1.1 reads 3e-4 (no dot) as a string
                    return float(value)
                except ValueError:
                    pass
            if p.startswith("dict") and isinstance(value, dict):
                return value
        raise ConfigError(f"{where} = {value!r} has the wrong type: expected {typ}")
    return value


def _section_from_dict(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"'{where.rstrip('.')}' must be a mapping of keys to values, got {data!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in known:
            raise _unknown_key(where, k, list(known))
        kwargs[k] = _coerce(f"{where}{k}", v, known[k].type)
    return cls(**kwargs)


def run_config_from_dict(data: dict) -> RunConfig:
    data = data or {}
    sections = {f.name: f for f in dataclasses.fields(RunConfig)}
    kwargs = {}
    for k, v in data.items():
        if k not in sections:
            raise _unknown_key("", k, list(sections))
        if k == "deepspeed_config":
            kwargs[k] = _coerce(k, v, "str")
        else:
            kwargs[k] = _section_from_dict(sections[k].default_factory, v or {}, f"{k}.")
    return RunConfig(**kwargs)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`section.key=value` pairs; the value is parsed as YAML (numbers, booleans, lists, null)."""
    data = copy.deepcopy(data or {})
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.lr=3e-4")
        path, raw = item.split("=", 1)
        keys = path.strip().split(".")
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: '{k}' is not a section")
        node[keys[-1]] = yaml.safe_load(raw)
    return data


def load_run_config(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    data = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"--config {path!r} does not exist; pass a run YAML such as recipes/tiny-v3.yaml")
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    return run_config_from_dict(apply_overrides(data, overrides or []))


# ------------------------------------------------------------------------------------------ DeepSpeed JSON
def load_ds_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"deepspeed_config {path!r} does not exist; pick one from ds_configs/")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"deepspeed_config {path!r} is not valid JSON: {e}") from e


def _auto_values(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    p = cfg.parallel
    dp = max(world_size // (p.pipeline_stages * p.tensor_parallel), 1)
    t = cfg.train
    gas = max(t.global_batch_size // max(t.micro_batch_size * dp, 1), 1)
    warm = t.warmup_steps
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 10 ** 9,  # the training loop reports progress itself
        "optimizer.params.lr": t.lr,
        "optimizer.params.betas": [t.beta1, t.beta2],
        "optimizer.params.eps": t.eps,
        "optimizer.params.weight_decay": t.weight_decay,
        "scheduler.params.total_num_steps": t.steps,
        "scheduler.params.warmup_num_steps": max(warm, 1),
        # Linear warm-up from lr/warmup (not from 0, which would waste the first step); constant when warmup is 0.
        "scheduler.params.warmup_min_ratio": 1.0 / warm if warm > 0 else 1.0,
        "scheduler.params.cos_min_ratio": t.min_lr / t.lr if t.lr > 0 else 0.0,
        "pipeline.stages": p.pipeline_stages,
        "pipeline.activation_checkpoint_interval": cfg.model.activation_checkpoint_interval,
    }


def resolve_ds_config(ds: dict, cfg: RunConfig, world_size: int) -> dict:
    """Fill every "auto" from the run config (as transformers' HF integration does), so batch sizes and the
    learning rate are written once. An explicit value that contradicts the run config is an error."""
    ds = copy.deepcopy(ds)
    auto = _auto_values(cfg, world_size)
    run_keys = {"train_batch_size": "train.global_batch_size", "train_micro_batch_size_per_gpu": "train.micro_batch_size",
                "optimizer.params.lr": "train.lr", "pipeline.stages": "parallel.pipeline_stages"}

    def walk(node: dict, prefix: str):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, key + ".")
            elif v == "auto":
                if key not in auto:
                    raise ConfigError(f"deepspeed_config: '{key}' is \"auto\" but deepseek-ds has no value for it; "
                                      "write an explicit value")
                node[k] = auto[key]
            elif key in run_keys and v != auto[key]:
                raise ConfigError(f"deepspeed_config: '{key}' = {v} contradicts the run config "
                                  f"{run_keys[key]} = {auto[key]}; set it to \"auto\" so the run config decides")

    walk(ds, "")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print"):
        ds.setdefault(key, auto[key])
    from .training.monitors import fill_output_paths

    fill_output_paths(ds, cfg.train.output_dir)
    return ds


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def precision(ds: dict) -> str:
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    return "fp32"


# ------------------------------------------------------------------------------------------ validate
def validate(cfg: RunConfig, ds: dict, world_size: int, cuda_available: bool | None = None) -> None:
    """Every check that can be made before processes start. Raises ConfigError listing all problems."""
    from .models.presets import ModelConfigError, build_model_config, num_routed_experts

    errors: list[str] = []
    p, t = cfg.parallel, cfg.train
    for name in ("pipeline_stages", "expert_parallel", "tensor_parallel"):
        if getattr(p, name) < 1:
            errors.append(f"parallel.{name} must be >= 1")
    for name in ("steps", "micro_batch_size", "global_batch_size"):
        if getattr(t, name) < 1:
            errors.append(f"train.{name} must be >= 1")
    if cfg.data.seq_len < 2:
        errors.append("data.seq_len must be >= 2")
    if errors:
        raise ConfigError("\n".join(errors))

    model_parallel = p.pipeline_stages * p.tensor_parallel
    if world_size % model_parallel:
        errors.append(f"world size {world_size} is not divisible by pipeline_stages({p.pipeline_stages}) x "
                      f"tensor_parallel({p.tensor_parallel}) = {model_parallel}; change parallel.pipeline_stages "
                      "or the number of ranks")
    else:
        dp = world_size // model_parallel
        if t.global_batch_size % (t.micro_batch_size * dp):
            errors.append(f"train.global_batch_size ({t.global_batch_size}) must equal micro_batch_size "
                          f"({t.micro_batch_size}) x grad_accum x data_parallel ({dp} = world {world_size} / "
                          f"(pp {p.pipeline_stages} x tp {p.tensor_parallel})); use a multiple of "
                          f"{t.micro_batch_size * dp}, e.g. {t.micro_batch_size * dp * max(1, round(t.global_batch_size / (t.micro_batch_size * dp)))}")
        if p.expert_parallel > 1 and dp % p.expert_parallel:
            errors.append(f"parallel.expert_parallel ({p.expert_parallel}) must divide the data-parallel size ({dp})")
    if p.tensor_parallel != 1:
        errors.append("parallel.tensor_parallel > 1 is not supported yet (DeepSeek-V3 itself trains without TP); set it to 1")

    stage = zero_stage(ds)
    prec = precision(ds)
    if stage not in (0, 1, 2, 3):
        errors.append(f"deepspeed_config zero_optimization.stage = {stage}: must be 0, 1, 2 or 3")
    if p.pipeline_stages > 1 and stage >= 2:
        errors.append(f"pipeline parallelism (parallel.pipeline_stages={p.pipeline_stages}) cannot be combined "
                      f"with ZeRO stage {stage} (DeepSpeed supports only ZeRO 0/1 with pipelines); use "
                      "ds_configs/zero1_pp.json or set parallel.pipeline_stages=1")
    if cuda_available is None:
        import torch
        cuda_available = torch.cuda.is_available()
    if prec == "fp16" and not cuda_available:
        errors.append("fp16 needs a CUDA GPU (DeepSpeed's CPU accelerator refuses it); on CPU use a bf16 config "
                      "such as ds_configs/zero1_bf16.json or an fp32 one")
    if prec == "bf16" and stage == 0:
        errors.append("bf16 with ZeRO stage 0 goes through DeepSpeed's FP16_Optimizer and its losses drift from "
                      "the ZeRO path; use ZeRO >= 1 for bf16 (e.g. ds_configs/zero1_bf16.json)")
    if "loss_scale" in ds.get("bf16", {}):
        errors.append("deepspeed_config bf16.loss_scale is not a DeepSpeed field (bf16 needs no loss scaling); remove it")

    if cfg.model.path and not os.path.isdir(cfg.model.path):
        errors.append(f"model.path {cfg.model.path!r} does not exist; point it at a local HF model directory")
    elif cfg.model.path is None and cfg.model.preset is None:
        errors.append("set model.preset (e.g. tiny-v3) or model.path (a local HF directory)")
    else:
        try:
            mcfg = build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides)
        except (ModelConfigError, TypeError, ValueError) as e:
            errors.append(str(e))
        else:
            n_layers = mcfg.num_hidden_layers + 3  # + embedding, final norm, head
            if p.pipeline_stages > n_layers:
                errors.append(f"parallel.pipeline_stages ({p.pipeline_stages}) exceeds the number of pipeline layers "
                              f"({n_layers}: {mcfg.num_hidden_layers} decoder layers + embedding, norm, head)")
            experts = num_routed_experts(mcfg)
            if p.expert_parallel > 1 and not experts:
                errors.append(f"parallel.expert_parallel = {p.expert_parallel} but model {mcfg.model_type} is dense; set it to 1")
            elif experts and experts % p.expert_parallel:
                errors.append(f"routed experts ({experts}) are not divisible by parallel.expert_parallel "
                              f"({p.expert_parallel}); choose a divisor of {experts}")
            if cfg.data.seq_len > mcfg.max_position_embeddings:
                errors.append(f"data.seq_len ({cfg.data.seq_len}) exceeds the model's max_position_embeddings "
                              f"({mcfg.max_position_embeddings})")
            errors += _moe_errors(cfg, ds, mcfg)
            errors += _mtp_errors(cfg, mcfg)

    if cfg.data.path:
        if not os.path.isdir(cfg.data.path):
            errors.append(f"data.path {cfg.data.path!r} does not exist; prepare one with "
                          "`deepseek-ds data prepare --input ... --out DIR` or use data.builtin: stdlib")
    elif cfg.data.builtin != "stdlib":
        errors.append(f"data.builtin = {cfg.data.builtin!r}: the only built-in corpus is 'stdlib'; or set data.path")
    if cfg.checkpoint.keep < 1:
        errors.append("checkpoint.keep must be >= 1")
    errors += _observability_errors(cfg, ds)
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


# ------------------------------------------------------------------------------------------ observability checks
def _observability_errors(cfg: RunConfig, ds: dict) -> list[str]:
    """Evaluation cadence, NaN policy, MFU peak, and monitors whose package is missing (issue 8)."""
    from .training import monitors, nan_policy

    errors = nan_policy.config_errors(cfg.train.nan_policy, ds) + monitors.missing_packages(ds)
    if cfg.train.peak_tflops is not None and cfg.train.peak_tflops <= 0:
        errors.append(f"train.peak_tflops = {cfg.train.peak_tflops}: must be > 0 (TFLOP/s of one device), or null")
    if cfg.eval.interval < 0 or cfg.eval.batches < 1:
        errors.append(f"eval.interval ({cfg.eval.interval}) must be >= 0 (0: no evaluation) and eval.batches "
                      f"({cfg.eval.batches}) >= 1")
    return errors


# ------------------------------------------------------------------------------------------ MTP checks
def _mtp_errors(cfg: RunConfig, mcfg) -> list[str]:
    from .models.layers import mtp_depth

    requested = int(getattr(mcfg, "num_nextn_predict_layers", 0) or 0)
    depth = mtp_depth(mcfg)
    weight = cfg.train.mtp_loss_weight
    if requested < 0:
        return [f"num_nextn_predict_layers = {requested}: the MTP depth must be >= 0 (model.overrides)"]
    if requested and not depth:
        return [f"num_nextn_predict_layers = {requested} but multi-token prediction is DeepSeek-V3's (model_type "
                f"deepseek_v3), not {mcfg.model_type}'s; remove it from model.overrides"]
    if weight < 0:
        return [f"train.mtp_loss_weight = {weight} must be >= 0"]
    if depth and weight == 0:
        return [f"train.mtp_loss_weight = 0 leaves the model's {depth} MTP module(s) untrained; give it a weight "
                "(DeepSeek-V3 used 0.3, then 0.1) or set model.overrides.num_nextn_predict_layers: 0"]
    return []


# ------------------------------------------------------------------------------------------ MoE checks
def _moe_errors(cfg: RunConfig, ds: dict, mcfg) -> list[str]:
    """Load-balancing settings that the model cannot use, and expert parallelism set in the wrong place (issue 9)."""
    from .models.moe import resolve_settings

    m = cfg.moe
    errors = [f"moe.{k} = {v} must be >= 0 (0 turns it off) or null (the model family's default)"
              for k, v in dataclasses.asdict(m).items() if v is not None and v < 0]
    if errors:
        return errors
    settings = resolve_settings(m, mcfg)
    if settings is None:
        errors += [f"moe.{k} = {v} but model {mcfg.model_type} is dense (no routed experts); remove it"
                   for k, v in dataclasses.asdict(m).items() if v]
        return errors
    if settings.bias_update_speed > 0 and mcfg.model_type != "deepseek_v3":
        errors.append(f"moe.bias_update_speed = {settings.bias_update_speed}: {mcfg.model_type} routers have no "
                      "e_score_correction_bias (only DeepSeek-V3's do); set it to 0")
    for key in ("device_aux_alpha", "comm_aux_alpha"):
        if getattr(settings, key) > 0 and settings.device_groups == 1:
            errors.append(f"moe.{key} = {getattr(settings, key)} needs device groups, but the model's n_group is 1 "
                          "(one group: the loss is a constant); set it to 0 or model.overrides.n_group")
    if "expert_parallel" in ds:
        errors.append("deepspeed_config has an 'expert_parallel' section: set parallel.expert_parallel in the run "
                      "YAML instead (deepseek-ds writes the AutoEP section for the model)")
    if cfg.parallel.expert_parallel > 1 and cfg.parallel.pipeline_stages > 1:
        errors += _stages_without_experts(cfg, mcfg)
    return errors


def _stages_without_experts(cfg: RunConfig, mcfg) -> list[str]:
    """AutoEP refuses a pipeline stage that holds no MoE layer (it finds nothing to replace)."""
    from .models.pipeline import partition

    try:
        parts = partition(mcfg, cfg.parallel.pipeline_stages, cfg.model.partition_method, cfg.data.seq_len)
    except ValueError as e:
        return [str(e)]
    # Spec i (embedding at 0) is decoder layer i - 1; MoE from first_k_dense_replace on.
    moe_specs = set(range(mcfg.first_k_dense_replace + 1, mcfg.num_hidden_layers + 1))
    empty = [st for st in range(len(parts) - 1) if not moe_specs & set(range(parts[st], parts[st + 1]))]
    if not empty:
        return []
    return [f"parallel.expert_parallel = {cfg.parallel.expert_parallel} needs an MoE layer on every pipeline stage, "
            f"but stage(s) {empty} of partition {parts} hold none; change model.partition_method (e.g. "
            "counts:a,b,...) or parallel.pipeline_stages"]
