"""Integrity of a published tag: checkpoint.json's "files" records every other file of the tag directory (path
relative to it, size, and a checksum of its bytes: xxh3_64, or zlib.crc32 in checkpoints from before it; the record
names its algorithm, so both stay readable). Resume verifies the tag it chooses and falls back to the newest one
that verifies; retention counts only intact tags; `deepseek-ds checkpoint verify` checks a whole directory.

Saving: every rank flushes (fsync) and checksums the files it wrote itself, in parallel, before any collective:
DeepSpeed's model and optimizer files and ours are checksummed as they are written (HashingFile: no re-read),
another checkpoint engine's files are read back (record_written); rank 0 merges those records (merge_records),
checking that it sees every rank's files with their sizes (a checkpoint.dir that is not one shared filesystem is
refused there, before the tag is published) and checksumming only what no rank claimed (a file DeepSpeed wrote past
its checkpoint engine).

Cost: xxh3_64 runs at 3-10 GB/s on one core (zlib.crc32 at 0.7-2.3 GB/s; both measured on this busy 2-core
machine). Hashing while writing costs a save less than torch.save's own zip CRC-32 did, which HashedSaves turns off
(torch.load never checks it; checkpoint.json's checksum covers every byte); a resume costs each rank about a second
per GB of its share of the tag (the ranks split its files); the size checks that retention and the pre-launch
check use cost one stat() per file."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
import zlib
from pathlib import Path

import torch
import xxhash  # several times zlib.crc32's speed

from .format import META, CheckpointError, complete_tags, read_meta

FILES = "files"
CHECKSUMS = ("xxh3_64", "crc32")  # what a file's record may hold, newest first
CHECKSUM = CHECKSUMS[0]  # what new records hold
_CHUNK = 16 << 20
# How long rank 0 keeps looking for another host's files before calling the storage unshared: a network
# filesystem's attribute and lookup caches can lag a few seconds behind another client's writes.
VISIBLE_WAIT_S = 10.0


class _Crc32:
    """zlib.crc32 behind xxhash's interface."""

    def __init__(self):
        self._value = 0

    def update(self, data) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


def _hasher(name: str):
    return _Crc32() if name == "crc32" else xxhash.xxh3_64()


def checksum_of(path: str, name: str = CHECKSUM) -> int:
    h = _hasher(name)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.intdigest()


def recorded_checksum(rec: dict) -> str:
    """The algorithm of a file's record (older checkpoints: crc32)."""
    return next(name for name in CHECKSUMS if name in rec)


class HashingFile:
    """A write-only file whose bytes are checksummed (CHECKSUM) on their way to the disk, for torch.save(obj, f):
    its record costs no second read of the file. close() flushes it to stable storage (fsync) first, as
    record_written does: a rename publishes the tag later and must not reach the disk before the data. `hasher`: a
    thread that checksums a large write's bytes while they are written (xxhash lets go of the GIL)."""

    def __init__(self, path: str, hasher: concurrent.futures.Executor | None = None):
        self.path, self._hasher = str(path), hasher
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # open()'s mode, as torch.save
        self._hash, self.size = _hasher(CHECKSUM), 0
        self.error: OSError | None = None  # torch.save reports a failed write as its own "unexpected pos" error

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        hashed = None
        if self._hasher is not None and len(view) >= _CHUNK:
            hashed = self._hasher.submit(self._hash.update, view)
        else:
            self._hash.update(view)
        done = 0
        try:
            while done < len(view):  # in pieces: a tensor's whole storage in one write() went slower to the disk
                done += os.write(self._fd, view[done:done + _CHUNK])
        except OSError as e:
            self.error = e
            raise
        finally:
            if hashed is not None:
                hashed.result()
        self.size += len(view)
        return len(view)

    def flush(self) -> None:  # unbuffered: every write() went to the kernel already
        pass

    def __str__(self) -> str:
        # The path, as torch.save's file argument would be otherwise (what a hook on torch.save looks at). Not
        # __fspath__: torch.save would then open the path itself, past the checksum.
        return self.path

    def close(self) -> dict:
        """{"size", CHECKSUM} of what was written, after fsync."""
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
        return {"size": self.size, CHECKSUM: self._hash.intdigest()}


class HashedSaves:
    """torch.save (or ready bytes) of a series of files through HashingFiles, torch's own zip CRC-32 off meanwhile
    (torch.load never checks it, our checksum covers the same bytes, and it cost as much time as writing them), each
    file flushed (fsync) before the next is written: on this project's cloud disk a flush running in a thread while
    the next file was written made a save 3x slower than writing and flushing one file after the other (0.31 s vs
    0.10 s for 137 MB). records(): {path: {"size", CHECKSUM}} of the files written."""

    def __init__(self):
        self._records: dict[str, dict] = {}
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")

    def save(self, obj, path: str, **kwargs) -> None:
        def serialize(f: HashingFile) -> None:
            with _without_zip_crc32():
                torch.save(obj, f, **kwargs)

        self._write(path, serialize)

    def write(self, data: bytes, path: str) -> None:
        """A file of ready bytes, checksummed and flushed as save()'s are."""
        self._write(path, lambda f: f.write(data))

    def _write(self, path: str, fill) -> None:
        f = HashingFile(path, self._hasher)
        try:
            fill(f)
        except BaseException as e:
            f.close()
            if f.error is not None and f.error is not e:  # the disk's own error (ENOSPC, EFBIG), not torch's echo
                raise f.error from e
            raise
        self._records[str(path)] = f.close()

    def records(self) -> dict[str, dict]:
        self._hasher.shutdown()  # idle: every write waited for its checksum
        return dict(self._records)


def _without_zip_crc32():
    try:  # the switch is torch >= 2.6's; older ones compute the CRC as before
        from torch.utils.serialization import config
        config.save.compute_crc32  # noqa: B018
    except (ImportError, AttributeError):
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})


def record_written(tag_dir: str, paths: list[str], hashed: dict[str, dict] | None = None) -> dict[str, dict]:
    """{path relative to `tag_dir`: {"size", CHECKSUM}} of files this process wrote, each flushed to stable storage
    first (a rename publishes the tag later: it must not reach the disk before the data) and read back; `hashed`:
    {path: record} of files written through HashingFile (flushed and checksummed already)."""
    out = {os.path.relpath(path, tag_dir): rec for path, rec in (hashed or {}).items()}
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        out[os.path.relpath(path, tag_dir)] = {"size": os.path.getsize(path), CHECKSUM: checksum_of(path)}
    return out


def _visible_size(path: str) -> int | None:
    """The size this host sees, None when it sees no file. Opened, not just stat()ed: NFS revalidates a file's
    attributes on open (close-to-open consistency), so another client's finished writes show."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _unseen(tag_dir: str, records: list[dict]) -> dict[int, str]:
    """{rank: its first file this host does not see with the size it wrote}."""
    out = {}
    for rank, record in enumerate(records):
        for rel, rec in record["files"].items():
            size = _visible_size(os.path.join(tag_dir, rel))
            if size != rec["size"]:
                out[rank] = f"{rel} ({'missing' if size is None else f'{size} bytes'}, {rec['size']} written)"
                break
    return out


def merge_records(tag_dir: str, records: list[dict], wait_s: float = VISIBLE_WAIT_S) -> dict[str, dict]:
    """checkpoint.json's "files" from every rank's record_written ({"host", "files"}, index = rank), on rank 0:
    CheckpointError when this host does not see another rank's files (storage not shared between hosts); files
    nobody recorded (written by DeepSpeed outside its checkpoint engine) are checksummed here."""
    deadline = time.monotonic() + wait_s
    while (unseen := _unseen(tag_dir, records)) and time.monotonic() < deadline:
        time.sleep(1.0)
    if unseen:
        hosts = sorted({records[r]["host"] for r in unseen})
        example = next(iter(unseen.items()))
        raise CheckpointError(
            f"checkpoint.dir {os.path.dirname(tag_dir)} is not shared between hosts: rank 0 on host "
            f"{records[0]['host']} does not see what ranks {sorted(unseen)} on host(s) {', '.join(hosts)} wrote into "
            f"{tag_dir} (rank {example[0]}: {example[1]}), so the checkpoint is not published",
            hint="put checkpoint.dir (or train.output_dir) on a filesystem every host mounts at the same path "
                 "(NFS, Lustre, GPFS, ...); `deepseek-ds preflight --checkpoint-dir DIR` checks it")
    files = {rel: rec for record in records for rel, rec in record["files"].items()}
    unclaimed = [str(p) for p in sorted(Path(tag_dir).rglob("*")) if p.is_file()
                 and os.path.relpath(p, tag_dir) not in files and os.path.relpath(p, tag_dir) != META]
    files.update(record_written(tag_dir, unclaimed))  # flushed too: published bytes must be durable
    return dict(sorted(files.items()))


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


def check_tag(tag_dir: str, sizes_only: bool = False, part: tuple[int, int] = (0, 1)) -> TagCheck:
    """Verify a tag against its record: every recorded file present with its size, then (unless `sizes_only`) its
    checksum. Sizes first: a truncated file, the common damage, is found without reading anything. part = (k, n):
    checksum only every n-th file from the k-th (n ranks verify one tag together)."""
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
        k, n = part
        for rel, rec in list(files.items())[k::n]:
            name = recorded_checksum(rec)
            if checksum_of(os.path.join(tag_dir, rel), name) != rec[name]:
                return TagCheck(tag_dir, len(files), total, f"{rel} (checksum differs from the one written)")
    return TagCheck(tag_dir, len(files), total, None)


def newest_verified_tag(ckpt_dir: str, log: logging.Logger | None = None, sizes_only: bool = False) -> str | None:
    """The newest complete tag that verifies, warning about (and skipping) each newer damaged one; None: none."""
    for tag in reversed(complete_tags(ckpt_dir)):
        check = check_tag(os.path.join(ckpt_dir, tag), sizes_only=sizes_only)
        if check.ok:
            return tag
        if log:
            log.warning(damaged_warning(check.tag_dir, check.problem))
    return None


def damaged_warning(tag_dir: str, problem: str) -> str:
    return f"checkpoint {tag_dir} is damaged: {problem}; falling back to the previous complete checkpoint"


def intact_tags(ckpt_dir: str) -> list[str]:
    """Complete tags whose files all have their recorded sizes, oldest first (what retention counts)."""
    return [t for t in complete_tags(ckpt_dir) if check_tag(os.path.join(ckpt_dir, t), sizes_only=True).ok]
