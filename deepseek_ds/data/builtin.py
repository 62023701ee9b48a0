"""The built-in corpus: this machine's Python standard library sources, a real code corpus that needs
no download, turned into a dataset once per cache directory."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from .layout import META
from .prepare import prepare_dataset

# Fixed (never derived from `workers`) so the output does not depend on the worker count; ~1 MB keeps
# a few shards per worker on the default 8 MB corpus.
_BUILTIN_SHARD_MB = 1.0
_SKIP_DIRS = {"site-packages", "test", "tests", "__pycache__"}


def stdlib_files(max_mb: float) -> list[str]:
    """Sorted UTF-8 .py files of the standard library (no tests, no site-packages), in path order until
    the next file would pass `max_mb` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    chosen, budget = [], int(max_mb * 2**20)
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        data = path.read_bytes()
        if len(data) > budget:
            break
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few stdlib files are deliberately in other encodings; only here are they skipped
        chosen.append(str(path))
        budget -= len(data)
    return chosen


def builtin_dataset_dir(cache_dir: str, vocab_size: int, max_mb: float) -> str:
    """Where ensure_builtin_dataset keeps the corpus of these settings."""
    return str(Path(cache_dir) / f"stdlib-v{vocab_size}-{max_mb}mb")


def ensure_builtin_dataset(cache_dir: str, vocab_size: int = 2048, max_mb: float = 8.0, workers: int = 1,
                           *, progress: bool = True) -> str:
    """Build (once) the stdlib dataset with its own byte-level BPE and return its directory.

    Safe for concurrent callers on a shared filesystem: every racer writes identical bytes through
    atomic renames, and meta.json (written last) marks completion.
    """
    out = Path(builtin_dataset_dir(cache_dir, vocab_size, max_mb))
    if (out / META).is_file():
        return str(out)
    return prepare_dataset(stdlib_files(max_mb), str(out), vocab_size=vocab_size, workers=workers,
                           shard_mb=_BUILTIN_SHARD_MB, progress=progress)
