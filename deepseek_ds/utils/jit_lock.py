"""Stale JIT-build locks. torch builds an extension (DeepSpeed's fused_adam, cpu_adam, shm comm op, ...) holding
`<extensions dir>/<op>/lock` open from its O_EXCL creation until the build ends (torch.utils.file_baton); a process
killed mid-build (Ctrl-C, a timeout) leaves the file behind, and every later load waits in FileBaton.wait forever,
printing nothing. check_jit_locks() runs before anything loads an op: a lock that no live process holds is one
error naming the file; a live build is waited for, saying so.

A lock is held when a process on this host has it open (/proc/<pid>/fd). On a network filesystem a build on
another host that shares the directory is invisible there, so such a lock counts as live while its build directory
changes, and as stale after `idle_s` without a change."""

from __future__ import annotations

import glob
import os
import shlex
import time
from collections.abc import Callable

from .errors import UserError
from .private_api import torch_extensions_dir

# Filesystems no other host shares (a disk, RAM, a container's own root). Any other type (NFS, Lustre, GPFS, WekaFS,
# BeeGFS, sshfs, ...: too many to list) may hold another host's live build, whose holder is invisible here.
_LOCAL_FS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay", "fuse.fuse-overlayfs")


class StaleJitLock(UserError):
    """A JIT-build lock left by a killed build: the message names the file and the fixes."""


def extensions_root() -> str:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR (which importing deepseek_ds sets to a checkout's
    .cache/torch_extensions when the user has not), else its default (e.g. ~/.cache/torch_extensions/py311_cpu),
    from torch's own rule."""
    return os.path.normpath(torch_extensions_dir())


def lock_holders(path: str) -> list[int] | None:
    """Pids of the processes of this host that have `path` open; None where that cannot be told (no /proc, or a
    lock of another user, whose processes' files are not ours to see)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target, holders, hidden = os.path.realpath(path), [], False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            hidden = True
            continue
        except OSError:  # the process ended meanwhile
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    holders.append(int(pid))
                    break
            except OSError:
                continue
    try:
        foreign = hidden and os.stat(path).st_uid != os.getuid()
    except OSError:  # released meanwhile
        foreign = False
    return None if foreign and not holders else holders


def _network_fs(path: str) -> bool:
    """Whether `path` lives on a filesystem other hosts may share (the longest mount point of /proc/mounts)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return True  # cannot tell: do not call another host's build stale
    real = os.path.realpath(path)
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=("/", ""))
    return best[1] not in _LOCAL_FS


def _last_change(path: str) -> float:
    """The newest modification time in the lock's build directory (a build writes its objects there)."""
    folder = os.path.dirname(path)
    times = []
    for name in os.listdir(folder):
        try:
            times.append(os.stat(os.path.join(folder, name)).st_mtime)
        except OSError:
            continue
    return max(times, default=0.0)


def _orphans(folder: str) -> list[int]:
    """Pids of processes working in `folder`: torch runs ninja there, and ninja outlives a killed build's Python."""
    target, out = os.path.realpath(folder), []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == target:
                out.append(int(pid))
        except OSError:
            continue
    return out


def _stale(path: str) -> StaleJitLock:
    orphans = _orphans(os.path.dirname(path))
    still = (f"; the killed build's compiler (process {', '.join(map(str, orphans))}) still runs there: let it end "
             "or kill it first") if orphans else ""
    return StaleJitLock(
        f"{path} is left by a JIT build of DeepSpeed's {os.path.basename(os.path.dirname(path))!r} op that was killed "
        f"(no running build holds it), and every start would wait on it forever: remove it (rm {shlex.quote(path)}) and start "
        f"again, or build the ops elsewhere with TORCH_EXTENSIONS_DIR=<another directory>{still}")


def announce(line: str) -> None:
    print(line, flush=True)


def check_jit_locks(root: str | None = None, say: Callable[[str], None] | None = announce, poll_s: float = 1.0,
                    grace_s: float = 0.5, idle_s: float = 600.0) -> None:
    """Raise StaleJitLock for a lock under the extensions directory `root` (default: torch's) that no build holds;
    wait, with one line per lock through `say` (None: silently), until a live build's lock is gone. A lock whose
    holder cannot be seen here (another host's build on a shared filesystem, another user's) is stale once its build
    directory is `idle_s` unchanged."""
    try:
        root = root or extensions_root()
    except OSError:  # torch's default folder cannot even be made: no build ever held a lock there
        return
    for path in sorted(glob.glob(os.path.join(root, "*", "lock"))):
        op, announced = os.path.basename(os.path.dirname(path)), False
        while os.path.exists(path):
            holders = lock_holders(path)
            if holders == []:
                time.sleep(grace_s)  # torch closes the file a moment before it removes it
                if not os.path.exists(path):
                    continue
                holders = lock_holders(path)  # None now: its holder became invisible, so it is waited for
                if holders:
                    continue
            try:
                idle = time.time() - _last_change(path)
            except OSError:  # the build directory went away with the lock
                continue
            if not holders and (holders == [] and not _network_fs(path) or idle > idle_s):
                raise _stale(path)
            if not announced and say:
                who = (f"held by process {', '.join(map(str, holders))}" if holders else
                       f"no process of this host holds it: a build on another host or of another user? refused as "
                       f"stale after {idle_s:.0f} s without a change in its directory")
                say(f"deepseek-ds: waiting for the JIT build of DeepSpeed's {op!r} op to finish: {path} ({who})")
                announced = True
            time.sleep(poll_s)
