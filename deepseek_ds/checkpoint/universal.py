"""Between parallel layouts: a checkpoint converted into a DeepSpeed universal checkpoint (any data-parallel size,
ZeRO 1-3) whose parameter folders carry the DeepSpeed names of the container that will load it."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys

from deepspeed.checkpoint import ds_to_universal
from transformers import PretrainedConfig

from .format import UNIVERSAL_DONE, CheckpointError, is_converted, read_meta, saved_layout, universal_dir
from .safe_load import trusted_types_only
from .tensor_names import container_entries


def to_universal(tag_dir: str, scheme: str, config: PretrainedConfig, out: str | None = None, workers: int = 1) -> str:
    """Convert a ZeRO >= 1 checkpoint into a universal one whose parameter folders carry the names of `scheme`'s
    container; done once (published atomically, like a checkpoint). Returns the output directory."""
    out = out or universal_dir(tag_dir, scheme)
    if is_converted(out):
        return out
    meta = read_meta(tag_dir)
    saved = saved_layout(meta)
    if saved.zero_stage == 0:
        raise CheckpointError(f"{tag_dir} was saved with ZeRO stage 0, which has no optimizer shards to build a "
                              "universal checkpoint from; resume it with its own pipeline layout")
    parent, name = os.path.split(os.path.normpath(out))
    tmp = os.path.join(parent, f".{name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=tag_dir, output_folder=tmp, num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=False)
    # DeepSpeed's converter prints progress and draws two unlabelled bars: one labelled line instead, and its
    # output only if it fails.
    print(f"converting {tag_dir} into a DeepSpeed universal checkpoint ...", file=sys.stderr, flush=True)
    captured = io.StringIO()
    try:
        with trusted_types_only(), contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            ds_to_universal.main(args)
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise
    # It also points a `latest_universal` file in the parent directory at the temporary name: not ours to keep.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(parent, "latest_universal"))
    _rename_params(os.path.join(tmp, "zero"), config, saved.scheme, scheme, saved.autoep)
    with open(os.path.join(tmp, UNIVERSAL_DONE), "w") as f:
        json.dump({"source": tag_dir, "source_layout": meta["layout"], "scheme": scheme}, f, indent=2)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _rename_params(zero_dir: str, config: PretrainedConfig, src: str, dst: str, autoep: bool) -> None:
    if src == dst:
        return
    to_hf = {name: (entry.hf, entry.part) for name, entry in container_entries(config, src, autoep).items()}
    from_hf = {(entry.hf, entry.part): name for name, entry in container_entries(config, dst, autoep).items()}
    for name in os.listdir(zero_dir):
        if not os.path.isdir(os.path.join(zero_dir, name)):
            continue  # optimizer_state.pt: global optimizer settings
        if name not in to_hf:
            raise CheckpointError(f"universal checkpoint parameter {name!r} is not a {src} parameter of this model; "
                                  "the checkpoint was written for another model config")
        os.rename(os.path.join(zero_dir, name), os.path.join(zero_dir, from_hf[to_hf[name]]))
