"""The DeepSpeed JSON: loading it, filling its "auto" values from the run config (as transformers' DeepSpeed
integration does), what it says about precision, ZeRO stage, non-finite steps and monitors, and DeepSpeed's own
config model run over the result."""

from __future__ import annotations

import copy
import difflib
import functools
import importlib.util
import json
import os
from typing import Any

import pydantic
from deepspeed.autotuning.constants import AUTOTUNING
from deepspeed.profiling.constants import FLOPS_PROFILER
from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.constants import SCHEDULER
from deepspeed.runtime.swap_tensor.constants import AIO

from ..models.muon import RULE as MUON_RULE
from ..models.muon import is_muon
from ..models.tensor_parallel import tensor_parallel_section
from .loading import PROJECT_ROOT
from .schema import ConfigError, RunConfig

# Monitor section of the DeepSpeed JSON -> the package it imports (csv_monitor needs none).
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
# Explicit values that must agree with the run config, which owns them.
_RUN_OWNED = {"train_batch_size": "train.global_batch_size", "train_micro_batch_size_per_gpu": "train.micro_batch_size",
              "optimizer.params.lr": "train.lr", "pipeline.stages": "parallel.pipeline_stages"}


def load_ds_config(path: str) -> dict:
    if not os.path.isfile(path):
        shipped = os.path.join(PROJECT_ROOT, "ds_configs")
        names = sorted(n for n in os.listdir(shipped) if n.endswith(".json")) if os.path.isdir(shipped) else []
        raise ConfigError(f"deepspeed_config {path!r} does not exist; the shipped configs are in {shipped} "
                          f"({', '.join(names)})")
    with open(path) as f:
        try:
            ds = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"deepspeed_config {path!r} is not valid JSON: {e}") from e
    if not isinstance(ds, dict):
        raise ConfigError(f"deepspeed_config {path!r} must be a JSON object, got {type(ds).__name__}")
    return ds


def _auto_values(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    t, warm = cfg.train, cfg.train.warmup_steps
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps(cfg.data_parallel_size(world_size)),
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
        "pipeline.stages": cfg.parallel.pipeline_stages,
        "pipeline.activation_checkpoint_interval": cfg.model.activation_checkpoint_interval,
    }


def _fill_auto(node: dict, prefix: str, auto: dict[str, Any]) -> None:
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            _fill_auto(v, key + ".", auto)
        elif v == "auto":
            if key not in auto:
                raise ConfigError(f"deepspeed_config: '{key}' is \"auto\" but deepseek-ds has no value for it; "
                                  "write an explicit value")
            node[k] = auto[key]
        elif key in _RUN_OWNED and v != auto[key]:
            raise ConfigError(f"deepspeed_config: '{key}' = {v} contradicts the run config "
                              f"{_RUN_OWNED[key]} = {auto[key]}; set it to \"auto\" so the run config decides")


def resolve_ds_config(ds: dict, cfg: RunConfig, world_size: int) -> dict:
    """Fill every "auto" from the run config, so batch sizes and the learning rate are written once. An explicit
    value that contradicts the run config is an error. A JSON without an `optimizer` section gets AdamW with the
    run config's values (DeepSpeed would otherwise assert on every rank that ZeRO needs an optimizer). With
    parallel.tensor_parallel > 1 it adds the `tensor_parallel` (AutoTP) section for the model's family."""
    ds = copy.deepcopy(ds)
    auto = _auto_values(cfg, world_size)
    if "optimizer" not in ds:
        ds["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
    _fill_auto(ds, "", auto)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print"):
        ds.setdefault(key, auto[key])
    fill_output_paths(ds, cfg.train.output_dir)
    if cfg.parallel.tensor_parallel > 1:
        model_type = cfg.model.hf_config.model_type
        ds["tensor_parallel"] = tensor_parallel_section(model_type, cfg.parallel.tensor_parallel)
    return ds


def filled_sections(ds_raw: dict) -> list[str]:
    """What resolve_ds_config adds that the user's JSON did not say, one line each, for the log and the record
    (with Muon: which parameters it updates, the tags deepseek-ds gives them)."""
    if is_muon(ds_raw):
        return [f"optimizer Muon: {MUON_RULE} (deepseek_ds/models/muon.py)"]
    if "optimizer" in ds_raw:
        return []
    return ["deepspeed_config has no 'optimizer' section: using AdamW with train.lr, train.beta1/beta2, train.eps "
            "and train.weight_decay from the run config"]


# ------------------------------------------------------------------------------------------ top-level keys
@functools.lru_cache(maxsize=1)
def deepspeed_top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeed reads. Its top level is no pydantic model (an unknown key, such as a misspelt
    `zero_optimisation`, is silently ignored), so the set comes from DeepSpeed itself: the keys DeepSpeedConfig
    asks of a config dict while parsing one, plus the sections read elsewhere or by `in param_dict.keys()`
    (scheduler, activation checkpointing, the flops profiler, aio, autotuning: their constants)."""
    asked: set[str] = set()

    class Recorder(dict):
        def get(self, key, *default):
            asked.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            asked.add(key)
            return super().__contains__(key)

    try:
        DeepSpeedConfig(Recorder(train_micro_batch_size_per_gpu=1, optimizer={"type": "AdamW", "params": {}}),
                        mpu=None)
    except Exception:  # a DeepSpeed that parses differently still gives the keys asked so far
        pass
    return frozenset(asked | {SCHEDULER, ACT_CHKPT, FLOPS_PROFILER, AIO, AUTOTUNING})


def unknown_top_level_keys(ds: dict) -> list[str]:
    """A line per top-level key of the DeepSpeed JSON that DeepSpeed does not read, with its nearest spelling."""
    valid = deepspeed_top_level_keys()
    errors = []
    for key in ds:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "remove it"
        errors.append(f"deepspeed_config: unknown top-level key '{key}' (DeepSpeed would silently ignore it); {hint}")
    return errors


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def offloads(ds: dict, what: str) -> bool:
    """Whether ZeRO offloads `what` ("optimizer" or "param": DeepSpeed's offload_<what> section) to CPU or NVMe."""
    return ds.get("zero_optimization", {}).get(f"offload_{what}", {}).get("device", "none") != "none"


def precision(ds: dict) -> str:
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    return "fp32"


def skips_nonfinite_steps(ds: dict) -> bool:
    """Whether DeepSpeed discards an optimizer step with non-finite gradients under this DeepSpeed config."""
    stage, prec = zero_stage(ds), precision(ds)
    if prec == "fp16":
        return True  # the loss scaler's overflow check, at every stage
    if stage == 0:
        return False  # the plain torch optimizer (fp32; bf16 with stage 0 is refused by validate)
    if stage in (1, 2):
        # ZeRO-1/2 see it through the gradient norm (not computed with compute_grad_norm=false), and in bf16
        # only with bf16.check_grad_overflow (DeepSpeed's default: true).
        if not ds.get("zero_optimization", {}).get("compute_grad_norm", True):
            return False
        return prec != "bf16" or ds.get("bf16", {}).get("check_grad_overflow", True)
    return True  # ZeRO-3 always discards a step whose gradient norm is not finite


# ------------------------------------------------------------------------------------------ monitors
def enabled_monitors(ds: dict) -> list[str]:
    return [name for name in (*MONITOR_PACKAGES, "csv_monitor") if ds.get(name, {}).get("enabled")]


def missing_monitor_packages(ds: dict) -> list[str]:
    """Config errors for enabled monitors whose package is not importable here. DeepSpeed would only fail
    inside deepspeed.initialize on rank 0, leaving the other ranks waiting in a collective."""
    errors = []
    for name in enabled_monitors(ds):
        pkg = MONITOR_PACKAGES.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            errors.append(f"deepspeed_config {name}.enabled is true but the '{pkg}' package is not installed: "
                          f"`pip install {pkg}` (or `pip install -e .[monitors]`) on every host, or disable {name}")
    return errors


def fill_output_paths(ds: dict, output_dir: str) -> None:
    """tensorboard/csv_monitor write to <cwd>/<job_name> when output_path is empty: put them in the run's
    directory instead."""
    for name in ("tensorboard", "csv_monitor"):
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled") and not section.get("output_path"):
            section["output_path"] = os.path.join(output_dir, "monitors")


# ------------------------------------------------------------------------------------------ checkpoint engines
def asynchronous_checkpoint_engines(ds: dict) -> list[str]:
    """The DeepSpeed checkpoint engines whose save_checkpoint returns before the files are durable (a background
    process writes them), which would let a save publish, fsync and checksum files not yet written. DeepSpeed
    0.19.8 picks them in runtime/checkpoint_engine/utils.py from these keys."""
    fix = ("deepseek-ds publishes a checkpoint only once every file is written and flushed, so it needs DeepSpeed's "
           "synchronous engine")
    errors = []
    writer = ds.get("checkpoint", {}).get("writer")
    if isinstance(writer, dict) and writer.get("decoupled"):
        errors.append(f"deepspeed_config checkpoint.writer.decoupled = true selects DeepSpeed's decoupled "
                      f"(asynchronous) checkpoint engine; {fix}: remove it or set it to false")
    if "nebula" in ds:
        errors.append(f"deepspeed_config 'nebula' asks for the asynchronous Nebula checkpoint engine (removed from "
                      f"DeepSpeed 0.19, which refuses the section); {fix}: remove the section")
    # DeepSpeed enables DataStates whenever the key is present and not literally false (an empty {} included).
    if ds.get("datastates_ckpt", False) is not False:
        errors.append(f"deepspeed_config 'datastates_ckpt' enables the asynchronous DataStates checkpoint engine; "
                      f"{fix}: remove the section")
    return errors


# ------------------------------------------------------------------------------------------ DeepSpeed's own check
def deepspeed_refusals(resolved: dict) -> list[str]:
    """What DeepSpeed's own config parser (its pydantic section models: unknown or mistyped keys at any depth)
    refuses in a resolved JSON, one line per problem naming the key. It runs without a process group, as a world of
    one rank, so the batch size is left for it to derive (validate() checks the batch arithmetic itself)."""
    check = {k: v for k, v in resolved.items() if k != "train_batch_size"}
    try:
        DeepSpeedConfig(check, mpu=None)
    except pydantic.ValidationError as e:
        return [_pydantic_line(resolved, e.title, err) for err in e.errors()]
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        return [f"deepspeed_config: DeepSpeed refuses it: {e}"]
    return []


def _pydantic_line(resolved: dict, model: str, err: dict) -> str:
    loc = [str(part) for part in err.get("loc", ())]
    key = ".".join(_key_path(resolved, loc) or loc)
    line = f"deepspeed_config '{key}': {err.get('msg', 'invalid')} (DeepSpeed's {model})"
    if err.get("type") == "extra_forbidden" and loc:
        close = difflib.get_close_matches(loc[-1], _model_keys(model), n=1)
        if close:
            line += f"; did you mean '{close[0]}'?"
    return line


def _key_path(node: Any, loc: list[str], prefix: tuple = ()) -> list[str] | None:
    """The full dotted path in `node` of the keys `loc` (pydantic's location is relative to its section)."""
    if not isinstance(node, dict):
        return None
    inner: Any = node
    for part in loc:
        inner = inner.get(part) if isinstance(inner, dict) else None
        if inner is None:
            break
    else:
        return [*prefix, *loc]
    for k, v in node.items():
        found = _key_path(v, loc, (*prefix, k))
        if found:
            return found
    return None


def _model_keys(model: str) -> list[str]:
    """The keys (field names and their JSON aliases) of DeepSpeed's config model called `model`."""
    classes = [DeepSpeedConfigModel]
    while classes:
        cls = classes.pop()
        if cls.__name__ == model:
            return [name for n, f in cls.model_fields.items() for name in (n, f.alias) if name]
        classes += cls.__subclasses__()
    return []


def expert_gradient_path_errors(ds: dict) -> list[str]:
    """ZeRO 1/2 reduce expert gradients within their expert-data-parallel groups only on DeepSpeed's contiguous,
    reduce-scatter gradient path. Measured on 2 ranks with EP=2 (DeepSpeed 0.19.8): with contiguous_gradients off,
    stage 1 all-reduces them over the whole data-parallel group, mixing different experts' gradients (losses 6e-4 off
    the reference after one step, DeepSpeed only warning "experimental"); stage 2, or reduce_scatter off, stops every
    rank with an assertion."""
    # DeepSpeed forces contiguous gradients when it offloads the optimizer.
    keys = ("reduce_scatter",) if offloads(ds, "optimizer") else ("contiguous_gradients", "reduce_scatter")
    off = [key for key in keys if ds.get("zero_optimization", {}).get(key, True) is False]
    return [f"zero_optimization.{key} = false with parallel.expert_parallel > 1 and ZeRO stage {zero_stage(ds)}: "
            "DeepSpeed reduces expert gradients within their expert-data-parallel groups only with it on; remove the "
            "key (DeepSpeed's default is true)" for key in off]
