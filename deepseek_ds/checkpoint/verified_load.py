"""Resume at read speed: DeepSpeed's native load of a tag, each of its files read from the disk once, and checksummed
on another core while the load reads it.

While engine.load_checkpoint runs, the checkpoint engine's load() of a recorded file hands the file to a hashing
thread and memory-maps it for torch.load (its tensors are read where the page cache holds them, not copied into new
storage first; DeepSpeed then copies them into the model and optimizer), and a file DeepSpeed loads twice in one
resume (the model states: once to read mp_world_size, once to load) is deserialized once. After the load the ranks
pool what they checksummed, and split the files nobody loaded (RNG states, buffers, DeepSpeed's scripts). A damaged
file cannot stop the load half-way (DeepSpeed's ZeRO load has collectives inside: one rank leaving it would hang the
others): it is found after it, on every rank together, and the caller loads an older tag over it.
"""

from __future__ import annotations

import concurrent.futures
import os

import torch
import torch.distributed as dist

from .format import read_meta
from .integrity import FILES, checksum_of, recorded_checksum


def _problem(tag_dir: str, rel: str, record: dict) -> str | None:
    name = recorded_checksum(record)
    if checksum_of(os.path.join(tag_dir, rel), name) != record[name]:
        return f"{rel} (checksum differs from the one written)"
    return None


def _is_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


class VerifiedLoads:
    """One resume's loads of `tag_dir`: load() while DeepSpeed loads (through io_engine.loading), problem() after it
    (a collective)."""

    def __init__(self, tag_dir: str):
        self.tag_dir = tag_dir
        self.files: dict[str, dict] = read_meta(tag_dir).get(FILES) or {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-verify")
        self._checks: dict[str, concurrent.futures.Future] = {}
        self._loaded: dict[str, object] = {}

    def load(self, path, map_location=None):
        """The checkpoint engine's load() of `path` (io_engine.loading): a recorded file is handed to the hashing
        thread, then memory-mapped for torch.load; a file loaded before is not deserialized again."""
        path = str(path)
        rel = os.path.relpath(path, self.tag_dir)
        if rel in self.files and rel not in self._checks:
            self._checks[rel] = self._pool.submit(_problem, self.tag_dir, rel, self.files[rel])
        if path not in self._loaded:
            self._loaded[path] = torch.load(path, map_location=map_location, weights_only=False,
                                            mmap=_is_zip(path))  # legacy (non-zip) files cannot be mapped
        return self._loaded[path]

    def release(self) -> None:
        """After DeepSpeed's load: drop the loaded states (DeepSpeed has copied them into the model and optimizer)."""
        self._loaded.clear()

    def problem(self, rank: int, world: int) -> str | None:
        """The first damaged file any rank found, the same on every rank (None: the tag verified)."""
        found = [f.result() for f in self._checks.values()]
        mine = set(self._checks)
        self._pool.shutdown()
        seen: list[set[str] | None] = [None] * world
        dist.all_gather_object(seen, mine)
        rest = [rel for rel in self.files if not any(rel in s for s in seen)]
        found += [_problem(self.tag_dir, rel, self.files[rel]) for rel in rest[rank::world]]
        problems: list[str | None] = [None] * world
        dist.all_gather_object(problems, next((p for p in found if p), None))
        return next((p for p in problems if p), None)
