"""The run configuration: typed sections loaded from YAML with `--set section.key=value` overrides (schema, loading),
the DeepSpeed JSON with its "auto" values filled from it (deepspeed_json), and ONE validate() that checks both and
the world size together before any work starts (validate); resolved ties them together for an entry point."""

from __future__ import annotations

from .deepspeed_json import (
    MONITOR_PACKAGES,
    deepspeed_refusals,
    enabled_monitors,
    fill_output_paths,
    filled_sections,
    load_ds_config,
    missing_monitor_packages,
    offloads,
    precision,
    resolve_ds_config,
    skips_nonfinite_steps,
    zero_stage,
)
from .loading import (
    PROJECT_ROOT,
    apply_overrides,
    load_run_config,
    read_yaml,
    recipe_base_dir,
    resolve_recipe_paths,
    run_config_from_dict,
)
from .resolved import RESOLVED_NAME, load_and_validate, write_resolved
from .schema import (
    NAN_POLICIES,
    CheckpointSection,
    ConfigError,
    DataSection,
    EvalSection,
    ModelSection,
    MoESection,
    ParallelSection,
    RunConfig,
    TrainSection,
)
from .validate import validate

__all__ = [
    "MONITOR_PACKAGES", "NAN_POLICIES", "PROJECT_ROOT", "RESOLVED_NAME", "CheckpointSection", "ConfigError",
    "DataSection", "EvalSection", "ModelSection", "MoESection", "ParallelSection", "RunConfig", "TrainSection",
    "apply_overrides", "deepspeed_refusals", "enabled_monitors", "fill_output_paths", "filled_sections",
    "load_and_validate", "load_ds_config", "load_run_config", "missing_monitor_packages", "offloads", "precision",
    "read_yaml",
    "recipe_base_dir", "resolve_ds_config", "resolve_recipe_paths", "run_config_from_dict", "skips_nonfinite_steps",
    "validate", "write_resolved", "zero_stage",
]
