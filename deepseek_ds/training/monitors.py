"""DeepSpeed's monitor back-ends (tensorboard, wandb, csv_monitor, comet) fed with our per-step metrics.

The plain engine logs only the learning rate by itself (the pipeline engine adds its train loss), so rank 0
writes every number of the per-step record to `engine.monitor`. The x value is the number of samples
consumed, the axis of DeepSpeed's own "Train/Samples/..." events: mixing it with optimizer steps would make
wandb's step go backwards and drop rows. Which monitors are on, their packages and output paths are properties of
the DeepSpeed JSON (config.deepspeed_json), checked by validate().
"""

from __future__ import annotations

# Not sent as values: step and sample count (the x value is the sample count), lr (DeepSpeed logs it itself).
_NOT_SENT = ("step", "lr", "consumed_samples")


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
        import wandb  # optional (the monitors extra), and only here when a wandb monitor is on

        wandb.finish()
