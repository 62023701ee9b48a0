"""One job per checkpoint.dir: rank 0 holds `checkpoint.dir/.lock` from before the resume (which removes `.partial`
directories) to the end of training, so an overlapping job (a Slurm requeue while the first still runs) is refused
at start instead of deleting the first job's save in progress and interleaving tags.

The lock file appears atomically with its content (written to a private file, then os.link()ed into place: link
fails when the name exists, also on NFS, where O_EXCL was long unreliable). It names the holder (host, pid, start
time); the holder touches it every HEARTBEAT_S seconds. A lock is stale, and taken over with a warning, when its pid
is dead on this host, or when its heartbeat is older than checkpoint.lock_stale_s (a holder on another host that
died). That age should be ten missed heartbeats or more: long enough for a loaded filesystem or a paused VM, short
enough that a requeued job whose predecessor's host vanished waits minutes, not hours. (Mtimes come from the file
server's clock on shared storage and are compared with this host's clock: skew between them eats into the margin.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import torch.distributed as dist

from .format import CheckpointError
from .run import TrainingRun

LOCK = ".lock"
HEARTBEAT_S = 30.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def describe(holder: dict) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}"


def _stale_reason(holder: dict | None, age_s: float, stale_s: float) -> str | None:
    if holder is None:
        return "its content is unreadable"
    if holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", -1))):
        return f"process {holder.get('pid')} is no longer running on this host"
    if age_s > stale_s:
        return f"its holder has not renewed it for {age_s:.0f} s (more than {stale_s:.0f} s)"
    return None


class DirLock:
    """A held lock; release() removes it if it is still ours and stops the heartbeat."""

    def __init__(self, path: str, token: str):
        self.path, self.token = path, token
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="checkpoint-lock", daemon=True)
        self._beat.start()

    def _ours(self) -> bool:
        return (_read(self.path) or {}).get("token") == self.token

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._ours():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _try_link(ckpt_dir: str, path: str, holder: dict) -> bool:
    tmp = os.path.join(ckpt_dir, f"{LOCK}.{holder['token']}.tmp")
    with open(tmp, "w") as f:
        json.dump(holder, f)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def _take_over(path: str, seen: dict | None, token: str) -> bool:
    """Move a stale lock aside; False when another job replaced it meanwhile (theirs is put back)."""
    aside = f"{path}.stale.{token}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True  # already gone: just try again to create ours
    if _read(aside) != seen:  # a racing job took it over first: this was its fresh lock, not the stale one
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        os.unlink(aside)
        return False
    os.unlink(aside)
    return True


_GONE = object()


def _inspect(path: str, stale_s: float) -> tuple[dict | object | None, str]:
    """(the holder, why its lock is stale) of an existing lock; (_GONE, "") when it vanished meanwhile.
    CheckpointError naming the holder and the fix when it is live."""
    seen = _read(path)
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return _GONE, ""
    reason = _stale_reason(seen, age, stale_s)
    if reason is None:
        raise CheckpointError(
            f"checkpoint.dir {os.path.dirname(path)} is in use by another job ({describe(seen)}; lock {path} renewed "
            f"{age:.0f} s ago)",
            hint="wait for that job to end or stop it, or give this run another checkpoint.dir (or "
                 f"train.output_dir); if that job is gone for good, delete {path}")
    return seen, reason


def check_free(ckpt_dir: str, stale_s: float) -> None:
    """CheckpointError when a live job holds `ckpt_dir` (taking nothing): lets every rank refuse before it spends
    minutes building an engine. checkpoint_lock still decides, atomically, once the job has started."""
    path = os.path.join(ckpt_dir, LOCK)
    if os.path.exists(path):
        _inspect(path, stale_s)


def acquire(ckpt_dir: str, stale_s: float, log: logging.Logger | None = None) -> DirLock:
    """Take the lock of `ckpt_dir` (created if needed); CheckpointError naming the holder when a live job has it."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, LOCK)
    token = uuid.uuid4().hex
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "started": time.time(), "token": token}
    for _ in range(3):  # a stale lock taken over by a racing job between our attempts: look again
        if _try_link(ckpt_dir, path, holder):
            return DirLock(path, token)
        seen, reason = _inspect(path, stale_s)
        if seen is _GONE:
            continue
        if log:
            log.warning("taking over the stale lock %s (%s): %s", path, describe(seen or {}), reason)
        _take_over(path, seen, token)
    raise CheckpointError(f"could not take the lock {path}: other jobs keep taking it",
                          hint="run one job per checkpoint.dir")


@contextlib.contextmanager
def checkpoint_lock(run: TrainingRun) -> Iterator[None]:
    """Every rank enters: rank 0 takes the lock and tells the others whether it got it, so a refused job ends on
    every rank with the same one-line error instead of hanging in the first collective."""
    lock, refusal = None, [None]
    if run.rank == 0:
        try:
            lock = acquire(run.cfg.checkpoint_dir, run.cfg.checkpoint.lock_stale_s, run.log)
        except CheckpointError as e:
            refusal[0] = (str(e.args[0]), e.hint)
        except OSError as e:  # e.g. a read-only directory: refused the same way on every rank
            refusal[0] = (f"cannot create the lock in checkpoint.dir {run.cfg.checkpoint_dir}: {e}",
                          "make the directory writable or choose another checkpoint.dir")
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise CheckpointError(*refusal[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
