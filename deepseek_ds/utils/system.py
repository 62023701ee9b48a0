"""The host a command runs on: its usable cores, its CPU's name, its local accelerators, and this environment's
`deepspeed` launcher."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys

import cpuinfo
import torch

from .errors import LaunchError

# Ranks a launch without --num_gpus starts on a host without CUDA: two, so that a CPU run is still distributed.
CPU_DEFAULT_RANKS = 2


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask: fewer than os.cpu_count() under Slurm or taskset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads_per_rank(local_ranks: int) -> int:
    """A CPU rank's share of this host's cores: the torch threads each of `local_ranks` ranks runs with unless
    OMP_NUM_THREADS says otherwise (training/process.share_cpu_threads sets it)."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, usable_cpus() // local_ranks)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: fall back to what the platform module knows
    return platform.processor() or platform.machine()


def cache_cpu_probe() -> None:
    """DeepSpeed's op builders ask py-cpuinfo for the CPU's architecture and SIMD width each time they load a JIT op
    (four calls a rank: the shared-memory comm op and fused Adam), and py-cpuinfo answers every call by starting a
    Python interpreter (~0.7 CPU-s each here). The CPU does not change within a process: the first answer is kept."""
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def local_device_count() -> int:
    """Ranks to start on this host by default: its CUDA devices, or CPU_DEFAULT_RANKS without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_DEFAULT_RANKS


def bin_dir() -> str:
    """The scripts directory of this interpreter's environment (its `deepspeed`, its `ninja`)."""
    return os.path.dirname(sys.executable)


def deepspeed_executable() -> str:
    """The `deepspeed` launcher of this environment, else the first on PATH. This environment's comes first: its
    ranks then import the same packages as the command that started them."""
    found = shutil.which("deepspeed", path=bin_dir()) or shutil.which("deepspeed")
    if found is None:
        raise LaunchError("the `deepspeed` launcher is not on PATH", hint="install deepspeed in this environment")
    return found


def launch_env(**extra: str) -> dict[str, str]:
    """The environment for a launched job: ours, with this environment's scripts first on PATH (the ranks must find
    this environment's ninja: one ninja per extension cache, or every JIT op rebuilds) and unbuffered output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PATH"] = bin_dir() + os.pathsep + env.get("PATH", "")
    return env
