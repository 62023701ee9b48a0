"""How many ranks a launch starts: --num_gpus, else the slots --hostfile (and --include/--exclude) select, else the
local devices."""

from __future__ import annotations

from deepseek_ds.launcher.hostfile import HostfileError, count_slots
from deepseek_ds.utils.system import local_device_count


def world_size(num_gpus: int | None = None, hostfile: str | None = None, include: str = "",
               exclude: str = "") -> int:
    if num_gpus:
        return num_gpus
    if hostfile:
        return count_slots(hostfile, include, exclude)
    if include or exclude:
        raise HostfileError("--include/--exclude select hosts and slots of a hostfile; give --hostfile too")
    return local_device_count()
