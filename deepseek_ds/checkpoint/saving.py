"""Saving a checkpoint so that a kill at any moment leaves the previous one usable: write into `.stepN.partial`,
flush, rename, then point `latest` at it; keep the newest `checkpoint.keep`."""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
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
from ..utils.fs import fsync_dir, write_bytes_atomic, write_json_atomic
from ..utils.private_api import COPY_RECOVERY_SCRIPT, instance_method_replaced
from ..utils.redact import redact
from .async_save import PinnedBuffers, copying_after, device_point, host_copy
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
from .frozen_experts import holds_frozen_experts
from .integrity import FILES, HashedSaves, intact_tags, merge_records, record_written
from .io_engine import recording
from .run import TrainingRun
from .state import buffers_file, expert_adapters, rng_path, rng_state


def save(run: TrainingRun, step: int, consumed_samples: int, *, background: bool = False) -> str:
    """Every rank calls this. Writes into `.stepN.partial`, then rank 0 publishes it by renaming it to `stepN`
    and pointing `latest` at it; a kill at any moment leaves at worst a `.partial` that resume ignores. Every rank
    flushes and checksums its own files before the collectives, so rank 0's work inside them is metadata only.

    background (checkpoint.async; run.saver): returns once DeepSpeed's state dicts are built and ours captured;
    run.saver's thread copies the state to host memory (the engine's next update waits for that copy,
    async_save.py), then writes, checksums, flushes and publishes it as above, over a process group of its own.
    Otherwise any save still in the background is waited for first."""
    cfg, engine = run.cfg, run.engine
    ckpt_dir, tag = cfg.checkpoint_dir, tag_for(step)
    partial, final = os.path.join(ckpt_dir, f".{tag}.partial"), os.path.join(ckpt_dir, tag)
    t0 = time.perf_counter()
    if run.saver is not None:
        run.saver.wait(step)  # one save at a time
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
    writes = Writes(deferred=background)
    with recording(engine, writes, holds_frozen_experts(engine.module)), _recovery_scripts_kept(engine):
        # LoRA: the frozen base stays out (resume reads it from model.path), so the checkpoint holds what changes.
        engine.save_checkpoint(ckpt_dir, tag=os.path.basename(partial), client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=cfg.lora.r > 0)
    writes.save(rng_state(), rng_path(partial, run.rank))
    if (adapters := expert_adapters(partial, run)) is not None:
        writes.save(*adapters)
    if run.layout.writes_replica_files:
        writes.write(*buffers_file(partial, run))
    if run.rank == 0:
        writes.write(os.path.join(partial, MODEL_CONFIG), lambda: run.model_config.to_json_string().encode())
    meta = (lambda: redact(_meta(run, tag, step, consumed_samples))) if run.rank == 0 else None
    publication = Publication(run.rank, run.world, partial, final, cfg.checkpoint.keep, meta)
    if background:
        point = device_point()
        run.saver.start(step, engine, lambda: writes.copy(point, run.saver.pinned),
                        lambda group: _complete(writes, publication, group), time.perf_counter() - t0)
        return final
    _complete(writes, publication, None)
    if run.rank == 0:
        run.log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
    return final


@dataclasses.dataclass
class Writes:
    """A save's files on this rank: DeepSpeed's model and optimizer files and ours (save(): torch.save; write():
    bytes), checksummed as they are written (HashedSaves). Written at once, or `deferred` (checkpoint.async): kept
    as references, copied to host memory by copy() and written by records(), both in the writer thread."""
    deferred: bool = False
    saves: HashedSaves = dataclasses.field(default_factory=HashedSaves)
    queued: list[tuple[object, str, dict]] = dataclasses.field(default_factory=list)  # torch.save's, deferred
    blobs: list[tuple[str, Callable[[], bytes] | bytes]] = dataclasses.field(default_factory=list)  # write's, deferred
    others: list[str] = dataclasses.field(default_factory=list)  # another engine's files, read back
    error: Exception | None = None  # a write (or copy) that failed, raised by records()

    def save(self, state, path: str, **kwargs) -> None:
        if self.deferred:
            self.queued.append((state, str(path), kwargs))
        else:
            self._now(lambda: self.saves.save(state, path, **kwargs), path)

    def write(self, path: str, data: Callable[[], bytes]) -> None:
        """A file of bytes; `data` is called when they are written, or copied when deferred."""
        if self.deferred:
            self.blobs.append((path, data))
        else:
            self._now(lambda: self.saves.write(data(), path), path)

    def _now(self, write, path: str) -> None:
        if self.error is not None:
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)  # ours: rng/, buffers/, expert_adapters/
            write()
        except OSError as e:  # a full disk: every rank must still reach _complete's gather, or they hang
            self.error = e

    def copy(self, point, pinned: PinnedBuffers) -> None:
        """The writer thread, before the engine's next update: the deferred state into host memory (a failure is
        kept for records(), which every rank reaches)."""
        try:
            with copying_after(point):
                self.queued = [(host_copy(state, pinned), path, kwargs) for state, path, kwargs in self.queued]
                self.blobs = [(path, data()) for path, data in self.blobs]
        except Exception as e:  # out of host memory: reported on every rank by _complete, nothing published
            self.error = e

    def records(self, tag_dir: str) -> dict[str, dict]:
        """Write what is deferred, then every file's record, all flushed."""
        if self.error is not None:
            raise self.error
        for state, path, kwargs in self.queued:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.saves.save(state, path, **kwargs)
        self.queued.clear()  # the copies go as soon as they are written
        for path, data in self.blobs:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.saves.write(data, path)
        return record_written(tag_dir, self.others, self.saves.records())


@dataclasses.dataclass(frozen=True)
class Publication:
    rank: int
    world: int
    partial: str
    final: str
    keep: int
    meta: Callable[[], dict] | None  # rank 0's checkpoint.json, less its "files"


def _complete(writes: Writes, pub: Publication, group) -> None:
    """Every rank: its files written and recorded, gathered on rank 0, which publishes the tag unless a rank failed;
    the outcome is broadcast, so every rank raises the same CheckpointError, or returns. `group`: the process group
    of the collectives (the background writer's own; None: the default)."""
    try:
        record = {"host": socket.gethostname(), "files": writes.records(pub.partial)}
    except Exception as e:  # disk full, I/O error: every rank must still reach the gather, or the others hang in it
        record = {"host": socket.gethostname(), "error": f"rank {pub.rank} on {socket.gethostname()}: {e}"}
    records = [None] * pub.world if pub.rank == 0 else None
    dist.gather_object(record, records, dst=0, group=group)  # every rank's files are written and flushed
    refusal, doomed, failure = [None], [], None
    if pub.rank == 0:
        failed = [r["error"] for r in records if "error" in r]
        try:
            if failed:
                refusal[0] = (f"the checkpoint {pub.final} was not published: {failed[0]}",
                              "free space or fix the storage of checkpoint.dir; the previous checkpoint is intact")
            else:
                doomed = _publish(pub, merge_records(pub.partial, records))
        except CheckpointError as e:  # storage not shared: refused on every rank, nothing published
            refusal[0] = (str(e.args[0]), e.hint)
        except OSError as e:  # disk full, a failed rename: the other ranks must not wait for dist_timeout_s
            failure, refusal[0] = e, (f"rank 0 could not publish {pub.final}: {e}", "see rank 0's log; the previous "
                                      "checkpoint is intact")
    dist.broadcast_object_list(refusal, src=0, group=group)  # nobody goes on (or exits) before the tag is published
    if failure is not None:
        raise failure
    if refusal[0] is not None:
        raise CheckpointError(*refusal[0])
    if doomed:
        _deletion.start(doomed)


RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # what DeepSpeed copies (COPY_RECOVERY_SCRIPT)


@contextlib.contextmanager
def _recovery_scripts_kept(engine) -> Iterator[None]:
    """DeepSpeed copies its recovery scripts into checkpoint.dir at every save; rewriting a file that holds them
    already truncates it, which waits for the filesystem's journal (about 24 ms of a 137 MB save here). In the
    block they are copied only when missing or different."""
    sources = os.path.join(os.path.dirname(deepspeed.__file__), "utils")

    def copy_when_changed(save_path):
        if not all(os.path.isfile(os.path.join(save_path, name)) and filecmp.cmp(
                os.path.join(sources, name), os.path.join(save_path, name), shallow=False) for name in RECOVERY_SCRIPTS):
            original(save_path)

    with instance_method_replaced(engine, COPY_RECOVERY_SCRIPT, copy_when_changed) as original:
        yield


def _publish(pub: Publication, files: dict) -> list[str]:
    """Rank 0: checkpoint.json, rename, `latest`; returns the renamed-aside directories left to delete."""
    ckpt_dir, tag = os.path.dirname(pub.final), os.path.basename(pub.final)
    meta = pub.meta()  # no credentials next to every checkpoint: redacted by save()
    meta[FILES] = files
    write_json_atomic(Path(pub.partial) / META, meta)
    for d, _, _ in os.walk(pub.partial):  # the files were flushed by their writers; their directory entries here
        fsync_dir(d)
    doomed = []
    if os.path.isdir(pub.final):  # the same step saved again (a resumed run re-reaching it): replace it
        doomed.append(_set_aside(pub.final))
    os.rename(pub.partial, pub.final)
    fsync_dir(ckpt_dir)
    write_bytes_atomic(Path(ckpt_dir) / LATEST, tag.encode())
    return doomed + _prune(ckpt_dir, pub.keep)


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
