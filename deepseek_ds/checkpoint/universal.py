"""Between parallel layouts: a checkpoint converted into a DeepSpeed universal checkpoint (any data-parallel size,
ZeRO 1-3) whose parameter folders carry the DeepSpeed names of the container that will load it."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import sys
import threading
import time

import torch.distributed as dist
from deepspeed.checkpoint import ds_to_universal
from transformers import PretrainedConfig

from ..models.muon import is_muon
from .format import (
    META,
    SCHEMES,
    UNIVERSAL_DONE,
    CheckpointError,
    is_converted,
    read_meta,
    saved_layout,
    universal_dir,
)
from .muon_universal import read_momentum, write_momentum, zero_moments_for_muon
from .safe_load import trusted_types_only
from .tensor_names import container_entries


def source_key(tag_dir: str) -> str:
    """What a conversion of `tag_dir` is valid for: the hash of its checkpoint.json, which records the size and
    checksum of every other file of the tag, so a tag saved again under the same name has another key."""
    with open(os.path.join(tag_dir, META), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def is_current(out: str, tag_dir: str) -> bool:
    """Whether `out` is a complete conversion of `tag_dir` as it is now (not of an earlier tag of that name)."""
    if not is_converted(out):
        return False
    try:
        with open(os.path.join(out, UNIVERSAL_DONE)) as f:
            return json.load(f).get("source_key") == source_key(tag_dir)
    except ValueError:  # a marker that is not JSON: convert again
        return False


def cached_universal(tag_dir: str, scheme: str, config: PretrainedConfig, work_dir: str) -> tuple[str, str]:
    """(its scheme, a current universal conversion of `tag_dir`): one already beside the tag, for any scheme, else
    one made there for `scheme`, which the next eval, generate, export or resume reuses (pruned with its tag). Only
    when the checkpoint directory is not writable is it made in `work_dir`, for this call alone."""
    for s in SCHEMES:
        if is_current(universal_dir(tag_dir, s), tag_dir):
            return s, universal_dir(tag_dir, s)
    if os.access(os.path.dirname(os.path.normpath(tag_dir)) or ".", os.W_OK):
        return scheme, to_universal(tag_dir, scheme, config)
    print(f"{os.path.dirname(tag_dir)} is not writable: the universal conversion is not kept for the next call",
          file=sys.stderr, flush=True)
    return scheme, to_universal(tag_dir, scheme, config, out=os.path.join(work_dir, "universal"))


def to_universal(tag_dir: str, scheme: str, config: PretrainedConfig, out: str | None = None, workers: int = 1) -> str:
    """Convert a ZeRO >= 1 checkpoint into a universal one whose parameter folders carry the names of `scheme`'s
    container; done once per version of the tag (published atomically, like a checkpoint; a conversion of an
    earlier tag of that name is replaced). Returns the output directory."""
    out = out or universal_dir(tag_dir, scheme)
    if is_current(out, tag_dir):
        return out
    meta = read_meta(tag_dir)
    saved = saved_layout(meta)
    if saved.zero_stage == 0:
        raise CheckpointError(f"{tag_dir} was saved with ZeRO stage 0, which has no optimizer shards to build a "
                              "universal checkpoint from; resume it with its own pipeline layout")
    parent, name = os.path.split(os.path.normpath(out))
    tmp = os.path.join(parent, f".{name}.{os.getpid()}.partial")  # per process: two evals may convert at once
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=tag_dir, output_folder=tmp, num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=False)
    # DeepSpeed's converter prints progress and draws two unlabelled bars: one labelled line instead, and its
    # output only if it fails.
    print(f"converting {tag_dir} into a DeepSpeed universal checkpoint ...", file=sys.stderr, flush=True)
    captured = io.StringIO()
    muon = None
    if is_muon(meta["deepspeed_config"]):  # DeepSpeed's converter carries AdamW's moments only
        with trusted_types_only():
            muon = read_momentum(tag_dir, saved.zero_stage)
    try:
        with trusted_types_only(), contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured), \
                zero_moments_for_muon() if muon is not None else contextlib.nullcontext():
            ds_to_universal.main(args)
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise
    # It also points a `latest_universal` file in the parent directory at the temporary name: not ours to keep.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(parent, "latest_universal"))
    renamed = _rename_params(os.path.join(tmp, "zero"), config, saved.scheme, scheme, saved.autoep)
    if muon is not None:
        write_momentum(tmp, muon, renamed)
    with open(os.path.join(tmp, UNIVERSAL_DONE), "w") as f:
        json.dump({"source": tag_dir, "source_key": source_key(tag_dir), "source_layout": meta["layout"],
                   "scheme": scheme}, f, indent=2)
    # Another process (a second eval) may have published this version meanwhile, and may be reading it: keep it.
    if is_current(out, tag_dir):
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if os.path.isdir(out):  # a conversion of an earlier tag of that name
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:  # it published between our look and our rename
        if not is_current(out, tag_dir):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# Rank 0 renews its status file this often while converting; the other ranks give up when it has not changed for
# CONVERTER_SILENT_S (its process died: on another host nothing else tells them). Changes are timed on the waiting
# host's clock, so clock skew between hosts does not matter.
CONVERTING_HEARTBEAT_S = 5.0
CONVERTER_SILENT_S = 120.0


def convert_on_rank0(tag_dir: str, scheme: str, config: PretrainedConfig, rank: int) -> str:
    """Every rank calls this. Rank 0 converts (to_universal) while the others wait for the result by polling, not
    in a collective: a collective would fail after train.dist_timeout_s, and converting a large model can take
    longer. They fail only when rank 0 reports an error or stops renewing its status file. Returns the output."""
    out = universal_dir(tag_dir, scheme)
    status = _status_path(out)
    if rank == 0:
        _write_status(status, {"state": "converting", "host": socket.gethostname(), "pid": os.getpid()})
        if is_converted(out) and not is_current(out, tag_dir):  # the others must not take it for the result
            shutil.rmtree(out)
    dist.barrier()  # the status file is this run's before anyone reads it
    if rank == 0:
        stop = threading.Event()
        beat = threading.Thread(target=_renew, args=(status, stop), name="universal-heartbeat", daemon=True)
        beat.start()
        try:
            to_universal(tag_dir, scheme, config)
        except BaseException as e:
            _write_status(status, {"state": "failed", "error": str(e) or type(e).__name__})
            raise
        finally:
            stop.set()
            beat.join()
        os.remove(status)
    else:
        wait_for_conversion(out, status)
    dist.barrier()  # cheap: everyone is here once the conversion is published
    return out


def _status_path(out: str) -> str:
    parent, name = os.path.split(os.path.normpath(out))
    return os.path.join(parent, f".{name}.converting")


def _write_status(path: str, status: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


def _renew(path: str, stop: threading.Event) -> None:
    while not stop.wait(CONVERTING_HEARTBEAT_S):
        with contextlib.suppress(OSError):
            os.utime(path)


def wait_for_conversion(out: str, status: str, silent_s: float = CONVERTER_SILENT_S, poll_s: float = 1.0) -> None:
    """Return once `out` is a complete conversion; CheckpointError when rank 0 reports a failure or its status
    file has not changed for `silent_s`."""
    seen, changed = None, time.monotonic()
    while not is_converted(out):
        try:
            mtime = os.stat(status).st_mtime_ns
            with open(status) as f:
                state = json.load(f)
        except (FileNotFoundError, ValueError):  # removed once done (published just before), or being replaced
            mtime, state = seen, {}
        if state.get("state") == "failed":
            raise CheckpointError(f"rank 0 could not convert {out}: {state.get('error')}",
                                  hint="rank 0's log (logs/rank0.log) has the details")
        if mtime != seen:
            seen, changed = mtime, time.monotonic()
        elif time.monotonic() - changed > silent_s:
            raise CheckpointError(f"rank 0 stopped converting {out}: its status file {status} has not been renewed "
                                  f"for {silent_s:.0f} s (its process died?)",
                                  hint="see rank 0's log (logs/rank0.log); the next resume converts again")
        time.sleep(poll_s)


def _rename_params(zero_dir: str, config: PretrainedConfig, src: str, dst: str, autoep: bool) -> dict[str, str]:
    """The parameter folders of `src`'s container renamed to `dst`'s; returns the renames."""
    if src == dst:
        return {}
    renamed = {}
    to_hf = {name: (entry.hf, entry.part) for name, entry in container_entries(config, src, autoep).items()}
    from_hf = {(entry.hf, entry.part): name for name, entry in container_entries(config, dst, autoep).items()}
    for name in os.listdir(zero_dir):
        if not os.path.isdir(os.path.join(zero_dir, name)):
            continue  # optimizer_state.pt: global optimizer settings
        if name not in to_hf:
            raise CheckpointError(f"universal checkpoint parameter {name!r} is not a {src} parameter of this model; "
                                  "the checkpoint was written for another model config")
        renamed[name] = from_hf[to_hf[name]]
        os.rename(os.path.join(zero_dir, name), os.path.join(zero_dir, renamed[name]))
    return renamed
