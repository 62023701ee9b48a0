"""The independent reference for a tag's record (checkpoint.json "files", as deepseek_ds/checkpoint/integrity.py
documents it): every file of the tag directory but checkpoint.json, read back by one process and hashed with xxhash's
xxh3_64 directly. Tests build fake tags with it and check the ranks' merged records against it."""

from __future__ import annotations

import os

import xxhash


def read_back_record(tag_dir) -> dict[str, dict]:
    """{path relative to tag_dir: {"size", "xxh3_64"}}, sorted by path."""
    out = {}
    for d, _, names in os.walk(tag_dir):
        for name in names:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, tag_dir)
            if rel != "checkpoint.json":
                with open(path, "rb") as f:
                    data = f.read()
                out[rel] = {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).intdigest()}
    return dict(sorted(out.items()))
