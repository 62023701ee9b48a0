"""A run's accepted configuration: the run YAML with its overrides and the DeepSpeed JSON, validated together for a
world size and resolved; and its record, resolved_config.yaml, beside the run's outputs."""

from __future__ import annotations

import logging
import os
import platform
from importlib import metadata
from pathlib import Path

import yaml

from ..utils.fs import write_bytes_atomic
from ..utils.redact import redact
from .deepspeed_json import filled_sections, load_ds_config, resolve_ds_config
from .loading import load_run_config
from .schema import RunConfig
from .validate import validate

RESOLVED_NAME = "resolved_config.yaml"


def load_and_validate(config: str | None, deepspeed_config: str | None = None, sets: list[str] | None = None,
                      world_size: int = 1, cuda_available: bool | None = None) -> tuple[RunConfig, dict]:
    """The run config and its resolved DeepSpeed JSON, or a ConfigError naming every problem. `deepspeed_config`
    (the command line's) wins over the run YAML's."""
    cfg = load_run_config(config, sets)
    if deepspeed_config:
        cfg.deepspeed_config = deepspeed_config
    ds_raw = load_ds_config(cfg.deepspeed_config)
    validate(cfg, ds_raw, world_size, cuda_available)
    return cfg, resolve_ds_config(ds_raw, cfg, world_size)


def write_resolved(cfg: RunConfig, ds: dict, world_size: int) -> str:
    """Write <output_dir>/resolved_config.yaml (the run, the DeepSpeed JSON as DeepSpeed gets it, what deepseek-ds
    filled in that the JSON lacked, the world size and the library versions), credentials redacted. Call it once
    the run is accepted, so a refused run leaves an earlier record alone."""
    os.makedirs(cfg.train.output_dir, exist_ok=True)
    versions = {"python": platform.python_version(),
                **{name: metadata.version(name) for name in ("torch", "deepspeed", "transformers")}}
    filled = filled_sections(load_ds_config(cfg.deepspeed_config))
    for line in filled:
        logging.getLogger("deepseek_ds").info("%s", line)
    doc = {"run": cfg.to_dict(), "deepspeed": ds, "filled_in": filled, "world_size": world_size, "versions": versions}
    path = os.path.join(cfg.train.output_dir, RESOLVED_NAME)
    write_bytes_atomic(Path(path), yaml.safe_dump(redact(doc), sort_keys=False).encode())
    return path
