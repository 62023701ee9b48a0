"""Saving a checkpoint so that a kill at any moment leaves the previous one usable: write into `.stepN.partial`,
flush, rename, then point `latest` at it; keep the newest `checkpoint.keep`."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import transformers
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)

from ..data import dataset_info
from ..utils.fs import write_bytes_atomic, write_json_atomic
from ..utils.redact import redact
from .format import (
    FORMAT_VERSION,
    LATEST,
    META,
    MODEL_CONFIG,
    complete_tags,
    current_layout,
    model_fingerprint,
    tag_for,
)
from .integrity import FILES, intact_tags, record_files
from .run import TrainingRun
from .state import save_buffers, save_rng


def save(run: TrainingRun, step: int, consumed_samples: int) -> str:
    """Every rank calls this. Writes into `.stepN.partial`, then rank 0 publishes it by renaming it to `stepN`
    and pointing `latest` at it; a kill at any moment leaves at worst a `.partial` that resume ignores."""
    cfg, engine = run.cfg, run.engine
    ckpt_dir, tag = cfg.checkpoint_dir, tag_for(step)
    partial, final = os.path.join(ckpt_dir, f".{tag}.partial"), os.path.join(ckpt_dir, tag)
    t0 = time.perf_counter()
    if run.rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    client_state = {"step": step, "consumed_samples": consumed_samples}
    if not engine.has_moe_layers:
        # ds_to_universal refuses checkpoints without it (resharding needs it); DeepSpeed's expert-parallel
        # save path writes this key itself and refuses it from the client.
        client_state[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    engine.save_checkpoint(ckpt_dir, tag=os.path.basename(partial), client_state=client_state, save_latest=False)
    save_rng(partial, run.rank)
    if run.dp_rank == 0:
        save_buffers(partial, run)
    dist.barrier()  # every rank's files are written
    if run.rank == 0:
        run.model_config.to_json_file(os.path.join(partial, MODEL_CONFIG))
        meta = redact(_meta(run, tag, step, consumed_samples))  # no credentials next to every checkpoint
        meta[FILES] = record_files(partial)  # reads the tag back once: see integrity.py for the cost
        write_json_atomic(Path(partial) / META, meta)
        _fsync_tree(partial)
        if os.path.isdir(final):  # the same step saved again (a resumed run re-reaching it): replace it
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(ckpt_dir)
        write_bytes_atomic(Path(ckpt_dir) / LATEST, tag.encode())
        _prune(ckpt_dir, cfg.checkpoint.keep)
        run.log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
    dist.barrier()  # nobody goes on (or exits) before the checkpoint is published
    return final


def _meta(run: TrainingRun, tag: str, step: int, consumed_samples: int) -> dict:
    return {
        "format_version": FORMAT_VERSION, "tag": tag, "step": step, "consumed_samples": consumed_samples,
        "world_size": run.world, "layout": dataclasses.asdict(current_layout(run)),
        "model_config": model_fingerprint(run.model_config),
        "tokenizer_hash": dataset_info(run.dataset_dir)["tokenizer_hash"],
        "dataset_dir": os.path.abspath(run.dataset_dir),
        "run_config": run.cfg.to_dict(), "deepspeed_config": run.ds,
        "versions": {"torch": str(torch.__version__), "deepspeed": deepspeed.__version__,
                     "transformers": transformers.__version__},
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Flush every file before the rename publishes them (the rename must not reach the disk before the data)."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(d)


def _prune(ckpt_dir: str, keep: int) -> None:
    """Keep the newest `keep` intact checkpoints (and any newer damaged ones), with their universal conversions:
    a damaged tag never counts, so the newest good one survives `keep: 1`. (Intact = every file has its recorded
    size; the tag just published was checksummed from its bytes a moment ago.)"""
    tags, kept = complete_tags(ckpt_dir), intact_tags(ckpt_dir)[-keep:]
    doomed = set(tags[:tags.index(kept[0])]) if kept else set()
    for name in os.listdir(ckpt_dir):
        if name.split(".")[0] in doomed:
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
