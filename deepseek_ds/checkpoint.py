"""Saving, retention and automatic resume of DeepSpeed checkpoints."""

from __future__ import annotations

import os
import re
import shutil

_TAG = re.compile(r"^step(\d+)$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(ckpt_dir: str) -> str | None:
    """The tag DeepSpeed's `latest` file names, if that checkpoint directory is there."""
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag if os.path.isdir(os.path.join(ckpt_dir, tag)) else None


def save(engine, ckpt_dir: str, step: int, client_state: dict, keep: int, is_rank0: bool) -> str:
    tag = tag_for(step)
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state)
    if is_rank0:
        _prune(ckpt_dir, keep)
    return os.path.join(ckpt_dir, tag)


def _prune(ckpt_dir: str, keep: int) -> None:
    tags = sorted(d for d in os.listdir(ckpt_dir) if _TAG.match(d))
    current = latest_tag(ckpt_dir)
    for old in tags[:-keep]:
        if old != current:
            shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)


def resume(engine, ckpt_dir: str) -> dict | None:
    """Load the newest complete checkpoint; returns its client state, or None for a fresh run."""
    tag = latest_tag(ckpt_dir)
    if tag is None:
        return None
    _, client_state = engine.load_checkpoint(ckpt_dir, tag=tag)
    return client_state
