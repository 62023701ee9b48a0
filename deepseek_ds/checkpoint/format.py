"""What a checkpoint is on disk: tags, metadata, the layout that wrote it, and whether it fits a run.

Under `checkpoint.dir`:

  .lock                   the job that uses this directory (host, pid, start time): see lock.py
  latest                  the newest complete tag, replaced atomically (os.replace) after it is published
  step00000200/           a complete checkpoint: only ever created by renaming a finished `.partial` directory
    *_model_states.pt, *_optim_states.pt, layer_*-model_states.pt    DeepSpeed's own files
    checkpoint.json       our metadata: step, consumed samples, layout, model fingerprint, tokenizer hash,
                          resolved run + DeepSpeed config, every other file's size and checksum (xxh3_64;
                          crc32 in older checkpoints) (integrity.py)
                          (written last, by rank 0, after a barrier)
    config.json           the transformers model config (what `export hf` rebuilds the model from)
    rng/rank_00000.pt     RNG states of every rank (python, numpy, torch, accelerator)
    buffers/stage_00.safetensors   persistent buffers (MoE e_score_correction_bias) by HF name: a universal
                          checkpoint holds only parameters, so a resharded resume restores buffers from here
  .step00000300.partial/  a save in progress or killed mid-way: never read, removed on the next resume
  step00000200.universal-sequential/   the universal conversion of a tag for another layout (a cache)

File names inside a tag directory must not start with DeepSpeed's prefixes (mp_rank_, layer_, zero_pp_rank_):
its universal converter collects files recursively by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import TYPE_CHECKING

from ..parallel.degrees import PIPELINE, SEQUENTIAL, Layout
from ..utils.errors import UserError

if TYPE_CHECKING:  # for annotations only: `checkpoint list` should not pay for importing transformers
    from transformers import PretrainedConfig

    from .run import TrainingRun

FORMAT_VERSION = 1
META = "checkpoint.json"
MODEL_CONFIG = "config.json"
LATEST = "latest"
UNIVERSAL_DONE = "universal.json"
TAG = re.compile(r"^step(\d{8,})$")
PARTIAL = re.compile(r"^\..+\.partial$")
# transformers config fields that do not change the weights or the math of a forward pass.
_NOT_MODEL_FIELDS = {"transformers_version", "architectures", "output_hidden_states", "output_attentions",
                     "return_dict", "dtype", "torch_dtype", "use_cache", "id2label", "label2id", "problem_type",
                     "chunk_size_feed_forward", "output_router_logits"}
# The lora fields that decide which tensors a checkpoint holds and what they mean (dropout changes neither).
_LORA_FIELDS = ("r", "alpha", "target_modules", "modules_to_save", "routed_experts")
# The two containers name parameters differently (see tensor_names): SequentialLM, DeepSeekPipelineModule.
SCHEMES = (SEQUENTIAL, PIPELINE)


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the checkpoint, the mismatch and the fix."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


# ----------------------------------------------------------------------------------------------- layout
def saved_layout(meta: dict) -> Layout:
    """The layout of a checkpoint. Checkpoints written before the layout recorded expert or sequence parallelism have
    them in their run config."""
    layout, parallel = dict(meta["layout"]), meta["run_config"].get("parallel", {})
    for key in ("expert_parallel", "sequence_parallel"):
        layout.setdefault(key, parallel.get(key, 1))
    return Layout.from_dict(layout)


def current_layout(run: TrainingRun) -> Layout:
    # Imported here: config imports transformers and DeepSpeed, which `checkpoint list` need not pay for.
    from ..config import precision

    engine, p = run.engine, run.cfg.parallel
    parts = tuple(int(bound) for bound in engine.module.parts) if run.pipeline else None
    # ZeRO's partitions: DeepSpeed's data-parallel ranks (sequence ranks count as data-parallel to it).
    return Layout(run.layout.gradient_size, p.pipeline_stages, p.tensor_parallel, p.sequence_parallel,
                  p.expert_parallel, int(engine.zero_optimization_stage()), precision(run.ds), parts,
                  engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())


def model_fingerprint(config: PretrainedConfig) -> dict:
    """The transformers config fields that define the model, JSON-normalised so saved and live ones compare."""
    d = json.loads(config.to_json_string(use_diff=False))
    return {k: v for k, v in sorted(d.items()) if k not in _NOT_MODEL_FIELDS and not k.startswith("_")}


# ----------------------------------------------------------------------------------------------- finding and reading
def read_meta(tag_dir: str) -> dict:
    path = os.path.join(tag_dir, META)
    if not os.path.isfile(path):
        raise CheckpointError(f"{tag_dir} is not a complete deepseek-ds checkpoint (no {META}); pass a checkpoint "
                              "directory (its newest complete step is used) or one of its step directories")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('format_version')}, this code reads "
                              f"{FORMAT_VERSION}: use the deepseek-ds version that wrote it")
    return meta


def complete_tags(ckpt_dir: str) -> list[str]:
    """Published checkpoints, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    tags = [d for d in os.listdir(ckpt_dir) if TAG.match(d) and os.path.isfile(os.path.join(ckpt_dir, d, META))]
    return sorted(tags, key=lambda t: int(TAG.match(t).group(1)))


def latest_tag(ckpt_dir: str) -> str | None:
    """The checkpoint to resume from: the newest complete one. (`latest`, kept for DeepSpeed's own tools, can lag
    behind it when a process dies between publishing a checkpoint and updating the file.)"""
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def tag_dir_of(path: str) -> str:
    """A step directory: `path` itself when it holds checkpoint.json, else the checkpoint directory's newest."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    tag = latest_tag(path)
    if tag is None:
        raise CheckpointError(f"{path} holds no complete deepseek-ds checkpoint (no step*/{META}); pass the "
                              "checkpoint.dir of a training run or one of its step directories")
    return os.path.join(path, tag)


def universal_dir(tag_dir: str, scheme: str) -> str:
    """Where the universal conversion of a tag for `scheme`'s container lives."""
    # Beside the tag directory, not in it: DeepSpeed's converter collects a tag's files recursively.
    return f"{os.path.normpath(tag_dir)}.universal-{scheme}"


def is_converted(path: str) -> bool:
    """Whether a universal conversion is complete (its marker is written last)."""
    return os.path.isfile(os.path.join(path, UNIVERSAL_DONE))


# ----------------------------------------------------------------------------------------------- compatibility
def check_compatible(tag_dir: str, meta: dict, model_config: PretrainedConfig, tokenizer_hash: str) -> None:
    """CheckpointError naming every difference when the checkpoint belongs to another model or tokenizer."""
    saved, now = meta["model_config"], model_fingerprint(model_config)
    problems = [f"model config {k}: checkpoint {saved.get(k)!r}, this run {now.get(k)!r}"
                for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if meta["tokenizer_hash"] != tokenizer_hash:
        problems.append(f"tokenizer hash: checkpoint {meta['tokenizer_hash'][:12]} (data {meta.get('dataset_dir')}), "
                        f"this run {tokenizer_hash[:12]}")
    if problems:
        raise CheckpointError(f"checkpoint {tag_dir} was trained with another model or tokenizer:\n  - "
                              + "\n  - ".join(problems)
                              + "\nfor a new run choose another train.output_dir (its checkpoints go to "
                              "<output_dir>/checkpoints unless checkpoint.dir is set); to resume this one, restore "
                              "the model and data settings it was trained with")


def check_lora_compatible(tag_dir: str, meta: dict, lora) -> None:
    """CheckpointError when the run's `lora` section (a config.schema.LoraSection) is not the checkpoint's: a full
    checkpoint holds no adapters, a LoRA one no base, and another r, target_modules or modules_to_save other
    tensors."""
    saved = meta["run_config"].get("lora", {"r": 0})  # a checkpoint from before the lora section: full fine-tuning
    if saved.get("r", 0) == lora.r == 0:
        return
    now = dataclasses.asdict(lora)
    fields = [k for k in _LORA_FIELDS if saved.get(k) != now[k]]
    if 0 in (saved.get("r", 0), lora.r):  # adapters on one side only: r alone is the difference
        fields = ["r"]
    if fields:
        theirs = ", ".join(f"lora.{k}: {json.dumps(saved.get(k))}" for k in fields)
        mine = ", ".join(f"lora.{k}: {json.dumps(now[k])}" for k in fields)
        raise CheckpointError(f"checkpoint {tag_dir} was trained with {theirs}, this run has {mine}: set {theirs} "
                              "to resume it, or choose another train.output_dir (or checkpoint.dir) for a new run")
