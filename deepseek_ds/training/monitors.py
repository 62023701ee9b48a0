"""DeepSpeed's monitor back-ends (tensorboard, wandb, csv_monitor, comet) fed with our per-step metrics.

The plain engine logs only the learning rate by itself (the pipeline engine adds its train loss), so rank 0
writes every number of the per-step record to `engine.monitor`. The x value is the number of samples
consumed, the axis of DeepSpeed's own "Train/Samples/..." events: mixing it with optimizer steps would make
wandb's step go backwards and drop rows.
"""

from __future__ import annotations

import importlib.util
import os

# Monitor section of the DeepSpeed JSON -> the package it imports (csv_monitor needs none).
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
# Not sent as values: step and sample count (the x value is the sample count), lr (DeepSpeed logs it itself).
_NOT_SENT = ("step", "lr", "consumed_samples")


def enabled(ds: dict) -> list[str]:
    return [name for name in (*PACKAGES, "csv_monitor") if ds.get(name, {}).get("enabled")]


def missing_packages(ds: dict) -> list[str]:
    """Config errors for enabled monitors whose package is not importable here. DeepSpeed would only fail
    inside deepspeed.initialize on rank 0, leaving the other ranks waiting in a collective."""
    errors = []
    for name in enabled(ds):
        pkg = PACKAGES.get(name)
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


def events(record: dict, samples: int) -> list[tuple[str, float, int]]:
    return [(f"Train/Samples/{key}", float(value), samples) for key, value in record.items()
            if key not in _NOT_SENT and isinstance(value, (int, float))]


def write(engine, record: dict, samples: int) -> None:
    """Send one record to every enabled monitor (rank 0 only; DeepSpeed's monitors ignore other ranks)."""
    if engine.monitor.enabled:
        engine.monitor.write_events(events(record, samples))


def finish(engine) -> None:
    """Close the wandb run while the process is healthy, so offline runs are complete on disk (DeepSpeed never
    finishes it; wandb's exit hook would run after the process group is gone)."""
    if getattr(engine.monitor, "wandb_monitor", None) is not None:
        import wandb

        wandb.finish()
