"""Saving a checkpoint so that a kill at any moment leaves the previous one usable: write into `.stepN.partial`,
flush, rename, then point `latest` at it; keep the newest `checkpoint.keep`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
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
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ..data import dataset_info
from ..utils.fs import fsync_dir, write_bytes_atomic, write_json_atomic
from ..utils.redact import redact
from .format import (
    FORMAT_VERSION,
    LATEST,
    META,
    MODEL_CONFIG,
    CheckpointError,
    complete_tags,
    current_layout,
    model_fingerprint,
    tag_for,
)
from .frozen_experts import holds_frozen_experts, marker_for
from .integrity import FILES, HashedSaves, intact_tags, merge_records, record_written
from .run import TrainingRun
from .state import save_buffers, save_expert_adapters, save_rng


def save(run: TrainingRun, step: int, consumed_samples: int) -> str:
    """Every rank calls this. Writes into `.stepN.partial`, then rank 0 publishes it by renaming it to `stepN`
    and pointing `latest` at it; a kill at any moment leaves at worst a `.partial` that resume ignores. Every rank
    flushes and checksums its own files before the collectives, so rank 0's work inside them is metadata only."""
    cfg, engine = run.cfg, run.engine
    ckpt_dir, tag = cfg.checkpoint_dir, tag_for(step)
    partial, final = os.path.join(ckpt_dir, f".{tag}.partial"), os.path.join(ckpt_dir, tag)
    t0 = time.perf_counter()
    if run.rank == 0:
        _deletion.join()  # the previous save's: one at a time, never racing this save's retention
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    client_state = {"step": step, "consumed_samples": consumed_samples}
    if not engine.has_moe_layers and not hasattr(engine.module, UNIVERSAL_CHECKPOINT_INFO):
        # ds_to_universal refuses checkpoints without it (resharding needs it); DeepSpeed's expert-parallel
        # save path writes this key itself and refuses it from the client, and AutoTP's module carries its own
        # (which TP dimension each tensor was split on), which this would replace.
        client_state[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    with _recording_saves(engine.checkpoint_engine, holds_frozen_experts(engine.module)) as (written, hashed):
        # LoRA: the frozen base stays out (resume reads it from model.path), so the checkpoint holds what changes.
        engine.save_checkpoint(ckpt_dir, tag=os.path.basename(partial), client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=cfg.lora.r > 0)
    written.append(save_rng(partial, run.rank))
    if (adapters := save_expert_adapters(partial, run)) is not None:
        written.append(adapters)
    if run.layout.writes_replica_files:
        written.append(save_buffers(partial, run))
    if run.rank == 0:
        written.append(os.path.join(partial, MODEL_CONFIG))
        run.model_config.to_json_file(written[-1])
    record = {"host": socket.gethostname(), "files": record_written(partial, written, hashed)}
    records = [None] * run.world if run.rank == 0 else None
    dist.gather_object(record, records, dst=0)  # every rank's files are written and flushed
    refusal, doomed, failure = [None], [], None
    if run.rank == 0:
        try:
            doomed = _publish(run, partial, final, merge_records(partial, records), step, consumed_samples)
        except CheckpointError as e:  # storage not shared: refused on every rank, nothing published
            refusal[0] = (str(e.args[0]), e.hint)
        except OSError as e:  # disk full, a failed rename: the other ranks must not wait for dist_timeout_s
            failure, refusal[0] = e, (f"rank 0 could not publish {final}: {e}", "see rank 0's log; the previous "
                                      "checkpoint is intact")
    dist.broadcast_object_list(refusal, src=0)  # nobody goes on (or exits) before the checkpoint is published
    if failure is not None:
        raise failure
    if refusal[0] is not None:
        raise CheckpointError(*refusal[0])
    if doomed:
        _deletion.start(doomed)
    if run.rank == 0:
        run.log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
    return final


@contextlib.contextmanager
def _recording_saves(checkpoint_engine, frozen_experts: bool = False) -> Iterator[tuple[list[str], dict[str, dict]]]:
    """The files DeepSpeed's checkpoint engine writes on this rank while the block runs (its save() is the one
    place every model, optimizer and layer file goes through): ([paths], {path: record}). DeepSpeed's own torch
    engine is replaced by the same torch.save through integrity.HashedSaves, so its files (nearly all the bytes)
    are checksummed as they are written (records without a re-read) and each is flushed while the next one is
    serialized. Any other engine's files are read back. frozen_experts: AutoEP's expert files are written as
    frozen_experts.py's markers."""
    written: list[str] = []
    hashed: dict[str, dict] = {}
    saves = HashedSaves()
    original = checkpoint_engine.save

    def content(state_dict, path):
        return (marker_for(path) if frozen_experts else None) or state_dict

    if type(checkpoint_engine) is TorchCheckpointEngine:
        def save(state_dict, path):
            saves.save(content(state_dict, path), path,
                       _use_new_zipfile_serialization=checkpoint_engine.zipfile_serialization)
    else:
        def save(state_dict, path):
            original(content(state_dict, path), path)
            written.append(str(path))

    checkpoint_engine.save = save
    try:
        yield written, hashed
        hashed.update(saves.records())
    finally:
        saves.close()
        del checkpoint_engine.save  # the class's method again


def _publish(run: TrainingRun, partial: str, final: str, files: dict, step: int, consumed_samples: int) -> list[str]:
    """Rank 0: checkpoint.json, rename, `latest`; returns the renamed-aside directories left to delete."""
    ckpt_dir, tag = os.path.dirname(final), os.path.basename(final)
    meta = redact(_meta(run, tag, step, consumed_samples))  # no credentials next to every checkpoint
    meta[FILES] = files
    write_json_atomic(Path(partial) / META, meta)
    for d, _, _ in os.walk(partial):  # the files were flushed by their writers; their directory entries here
        fsync_dir(d)
    doomed = []
    if os.path.isdir(final):  # the same step saved again (a resumed run re-reaching it): replace it
        doomed.append(_set_aside(final))
    os.rename(partial, final)
    fsync_dir(ckpt_dir)
    write_bytes_atomic(Path(ckpt_dir) / LATEST, tag.encode())
    return doomed + _prune(ckpt_dir, run.cfg.checkpoint.keep)


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


def _set_aside(path: str) -> str:
    """Rename a published directory to a `.partial` name before deleting it: a kill halfway through the deletion
    then leaves a `.partial` (removed at the next resume), never a tag whose checkpoint.json outlived its files."""
    aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.deleted.partial")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(path, aside)
    return aside


def _delete(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class _Deletion:
    """Rank 0 deletes old checkpoints in a thread: it can take long on a network filesystem and is rank 0's alone,
    so it must not hold the other ranks in a collective. Not a daemon: the process finishes it before exiting."""

    def __init__(self):
        self._thread: threading.Thread | None = None

    def start(self, paths: list[str]) -> None:
        self._thread = threading.Thread(target=_delete, args=(paths,), name="checkpoint-prune")
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


_deletion = _Deletion()  # one per process: rank 0's saves run one after another


def _prune(ckpt_dir: str, keep: int) -> list[str]:
    """Set aside all but the newest `keep` intact checkpoints (and any newer damaged ones), with their universal
    conversions, and return them for deleting: a damaged tag never counts, so the newest good one survives
    `keep: 1`. (Intact = every file has its recorded size; the tag just published was checksummed by its
    writers a moment ago.)"""
    tags, kept = complete_tags(ckpt_dir), intact_tags(ckpt_dir)[-keep:]
    doomed = set(tags[:tags.index(kept[0])]) if kept else set()
    return [_set_aside(os.path.join(ckpt_dir, name)) for name in sorted(os.listdir(ckpt_dir))
            if name.split(".")[0] in doomed]
