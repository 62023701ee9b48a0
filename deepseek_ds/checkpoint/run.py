"""What checkpointing reads of a training run. training.run.Run has these attributes; checkpoint sits below
training, so it names them here instead of importing it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # for annotations only: importing deepspeed and transformers costs seconds
    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers import PretrainedConfig

    from ..config import RunConfig
    from ..parallel.layout import RankLayout


class TrainingRun(Protocol):
    cfg: RunConfig
    ds: dict                         # the resolved DeepSpeed config
    engine: DeepSpeedEngine          # a PipelineEngine when `pipeline`
    model_config: PretrainedConfig
    dataset_dir: str
    rank: int
    world: int
    layout: RankLayout                   # parallel/layout.py
    dp_rank: int
    dp_size: int
    pipeline: bool
    log: logging.Logger
    hf_names: dict[str, str]         # DeepSpeed module name -> HF name, of this layout's parameters and buffers
    saver: object | None             # checkpoint.async: async_save.AsyncSaver (which imports this module's users)
