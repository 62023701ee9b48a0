"""Integrity of a published tag: checkpoint.json's "files" records every other file of the tag directory (path
relative to it, size, zlib.crc32 of its bytes). Resume verifies the tag it chooses and falls back to the newest one
that verifies; retention counts only intact tags; `deepseek-ds checkpoint verify` checks a whole directory.

Cost: rank 0 reads the whole tag back once when publishing it and once when resuming from it. zlib.crc32 runs at
about 1 GB/s on one core (0.85 GB/s measured on a busy 2-core CI machine) and the bytes just written are usually
still in the page cache, so this is about a second per GB of checkpoint on rank 0's host; the size checks that
retention and the pre-launch check use cost one stat() per file."""

from __future__ import annotations

import dataclasses
import logging
import os
import zlib

from .format import META, complete_tags, read_meta

FILES = "files"
_CHUNK = 16 << 20


def crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def record_files(tag_dir: str) -> dict[str, dict]:
    """{relative path: {"size", "crc32"}} of every file under `tag_dir` but checkpoint.json (which holds the record)."""
    out = {}
    for d, _, names in os.walk(tag_dir):
        for name in names:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, tag_dir)
            if rel != META:
                out[rel] = {"size": os.path.getsize(path), "crc32": crc32_of(path)}
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class TagCheck:
    """What verifying one tag found: `problem` is None when it verified, else the first bad file and why."""
    tag_dir: str
    files: int
    bytes: int
    problem: str | None
    recorded: bool = True  # False: written before checkpoints recorded their files (nothing to check against)

    @property
    def ok(self) -> bool:
        return self.problem is None


def check_tag(tag_dir: str, sizes_only: bool = False) -> TagCheck:
    """Verify a tag against its record: every recorded file present with its size, then (unless `sizes_only`) its
    checksum. Sizes first: a truncated file, the common damage, is found without reading anything."""
    try:
        meta = read_meta(tag_dir)
    except ValueError as e:  # CheckpointError, or JSON cut short
        return TagCheck(tag_dir, 0, 0, f"{META} (unreadable: {e})")
    files = meta.get(FILES)
    if files is None:
        return TagCheck(tag_dir, 0, 0, None, recorded=False)
    total = sum(r["size"] for r in files.values())
    for rel, rec in files.items():
        path = os.path.join(tag_dir, rel)
        if not os.path.isfile(path):
            return TagCheck(tag_dir, len(files), total, f"{rel} (missing)")
        size = os.path.getsize(path)
        if size != rec["size"]:
            return TagCheck(tag_dir, len(files), total, f"{rel} ({size} bytes, {rec['size']} written)")
    if not sizes_only:
        for rel, rec in files.items():
            if crc32_of(os.path.join(tag_dir, rel)) != rec["crc32"]:
                return TagCheck(tag_dir, len(files), total, f"{rel} (checksum differs from the one written)")
    return TagCheck(tag_dir, len(files), total, None)


def newest_verified_tag(ckpt_dir: str, log: logging.Logger | None = None, sizes_only: bool = False) -> str | None:
    """The newest complete tag that verifies, warning about (and skipping) each newer damaged one; None: none."""
    for tag in reversed(complete_tags(ckpt_dir)):
        check = check_tag(os.path.join(ckpt_dir, tag), sizes_only=sizes_only)
        if check.ok:
            return tag
        if log:
            log.warning("checkpoint %s is damaged: %s; falling back to the previous complete checkpoint",
                        check.tag_dir, check.problem)
    return None


def intact_tags(ckpt_dir: str) -> list[str]:
    """Complete tags whose files all have their recorded sizes, oldest first (what retention counts)."""
    return [t for t in complete_tags(ckpt_dir) if check_tag(os.path.join(ckpt_dir, t), sizes_only=True).ok]
