"""Atomic file and directory publication: readers see either nothing or the complete result.

Every write goes to a uniquely named temporary path in the same directory and is then renamed into
place, so a killed process leaves only temporaries behind and racing processes never interleave bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def _temp_name(target: Path) -> Path:
    # Unique per process and call: two racers must never share a temporary.
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    # mkstemp makes owner-only files; datasets on shared filesystems are read by other users' jobs.
    os.chmod(name, 0o644)
    return Path(name)


def write_bytes_atomic(target: Path, data: bytes) -> None:
    tmp = _temp_name(target)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(target: Path, obj: Any) -> None:
    # sort_keys + fixed indent: identical inputs give byte-identical files.
    write_bytes_atomic(target, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def temp_dir_for(target: Path) -> Path:
    """A fresh private directory next to `target`, to be filled and then passed to publish_dir."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    tmp.chmod(0o755)
    return tmp


def publish_dir(tmp: Path, target: Path) -> bool:
    """Rename a filled temporary directory to `target`.

    Returns False (and removes `tmp`) when another process published `target` first; the caller then
    uses the winner's copy so that all racers agree on one set of bytes.
    """
    try:
        os.rename(tmp, target)
        return True
    except OSError:
        if not target.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (new and renamed names) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
