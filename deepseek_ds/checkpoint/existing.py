"""Before any process starts: is checkpoint.dir free for this run, or does it hold a run this one can resume?

A run whose output directory already holds another model's or tokenizer's checkpoint would otherwise fail only at
resume, after every rank has built its engine. The same check_compatible runs again at resume (the built-in corpus
may not exist yet here, and files can change between the two)."""

from __future__ import annotations

import os

from ..config import RunConfig
from ..data import dataset_info
from ..data.builtin import builtin_dataset_dir
from ..data.layout import META as DATASET_META
from .format import check_compatible, check_lora_compatible, read_meta
from .integrity import newest_verified_tag
from .lock import check_free


def _dataset_dir(cfg: RunConfig, vocab_size: int) -> str | None:
    """The run's dataset if it exists already (data.path, or a built-in corpus prepared by an earlier run)."""
    path = cfg.data.named_dir or builtin_dataset_dir(cfg.data.cache_dir, vocab_size, cfg.data.builtin_max_mb)
    return path if os.path.isfile(os.path.join(path, DATASET_META)) else None


def check_existing_checkpoint(cfg: RunConfig) -> str | None:
    """The tag a launch of `cfg` would resume from (None: a fresh run); CheckpointError when checkpoint.dir holds a
    checkpoint of another model, tokenizer or lora section, or when another live job holds checkpoint.dir, with the fix."""
    check_free(cfg.checkpoint_dir, cfg.checkpoint.lock_stale_s)
    # Sizes only (a stat per file): every rank runs this before start-up; resume checks the checksums.
    tag = newest_verified_tag(cfg.checkpoint_dir, sizes_only=True)
    if tag is None:
        return None
    tag_dir = os.path.join(cfg.checkpoint_dir, tag)
    meta = read_meta(tag_dir)
    model = cfg.model.hf_config
    dataset = _dataset_dir(cfg, model.vocab_size)
    tokenizer_hash = dataset_info(dataset)["tokenizer_hash"] if dataset else meta["tokenizer_hash"]
    check_compatible(tag_dir, meta, model, tokenizer_hash)
    check_lora_compatible(tag_dir, meta, cfg.lora)
    return tag
