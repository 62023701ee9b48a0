"""One rank's process: distributed init (every group's timeout, DeepSpeed's CPU shared-memory buffers), its share of
the CPU threads, and logging (a file per rank, rank 0 on the console). Every distributed entry point passes here."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ..utils.jit_lock import announce, check_jit_locks
from ..utils.private_api import all_process_groups, group_timeout_s, set_group_timeout
from ..utils.system import cache_cpu_probe, cpu_threads_per_rank


def init_distributed(timeout_s: int = 1800) -> tuple[int, int]:
    if get_accelerator().communication_backend_name() == "nccl":
        # A failed or timed-out NCCL collective then aborts its communicator and ends the rank (so the launcher ends
        # the job) instead of leaving it blocked; a user's own setting wins.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # DeepSpeed's CPU backend prints "... shm_comm_op built successfully" on every rank, also when the op was
    # cached: drop that line, pass anything else through.
    cache_cpu_probe()  # before the first op loads (the shm comm op, here)
    # Every distributed entry point (eval, task eval, the benchmarks) passes here before its first op loads; a
    # training rank has already looked, before it wrote anything (training/main.py).
    check_jit_locks(say=None if int(os.environ.get("LOCAL_RANK", 0)) else announce)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        deepspeed.init_distributed(dist_backend=None, timeout=timedelta(seconds=timeout_s))
    sys.stdout.write("".join(line for line in printed.getvalue().splitlines(keepends=True)
                             if not line.endswith("built successfully\n")))
    release_shm_buffers()
    return dist.get_rank(), dist.get_world_size()


def apply_timeout_to_all_groups(timeout_s: int) -> list[float]:
    """Give every process group of this rank the world group's timeout; returns each group's timeout (s), read back.
    torch gives a group made by new_group(timeout=None) its backend's default (30 min gloo, 10 min NCCL), and
    DeepSpeed makes its data-parallel, pipeline and expert groups that way (deepspeed.comm.new_group takes no
    timeout), so a hung peer held them that long. Call it once the engine (and so every group) exists."""
    timeout = timedelta(seconds=timeout_s)
    groups = all_process_groups()
    for group in groups:
        set_group_timeout(group, timeout)
    return [group_timeout_s(g) for g in groups]


def release_shm_buffers() -> None:
    """DeepSpeed's CPU all-reduce maps one /dev/shm buffer per rank (~70 MB) and never unlinks it, so every
    run on one host leaves them behind until /dev/shm (RAM) is full. Once every rank has mapped its peers'
    buffers (init_distributed has returned everywhere), removing the names frees them at exit."""
    if not os.environ.get("MASTER_PORT") or get_accelerator().device_name() != "cpu":
        return
    dist.barrier()
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ['MASTER_PORT']}_{dist.get_rank()}")
    if os.path.exists(name):
        os.unlink(name)


def share_cpu_threads() -> int | None:
    """On CPU, give each local rank its share of the cores unless OMP_NUM_THREADS is set. With torch's default
    (every rank one thread per core) the ranks' spinning OpenMP threads starve each other: a 2-rank run on 2 cores
    ran many times slower. Returns the thread count it set, if any."""
    if "OMP_NUM_THREADS" in os.environ or get_accelerator().device_name() != "cpu":
        return None
    threads = cpu_threads_per_rank(local_ranks())
    torch.set_num_threads(threads)
    return threads


def local_ranks() -> int:
    """Ranks on this host, from whichever launcher started us: DeepSpeed's (LOCAL_SIZE), torchrun's
    (LOCAL_WORLD_SIZE), Open MPI's or Slurm's."""
    for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def setup_logging(output_dir: str, rank: int) -> logging.Logger:
    """Every rank logs to its own file (for post-mortems); only rank 0 also talks on the console.
    DeepSpeed's own INFO chatter goes to the files, not the terminal."""
    os.makedirs(os.path.join(output_dir, "logs"), exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(os.path.join(output_dir, "logs", f"rank{rank}.log"), mode="a")
    file_handler.setFormatter(fmt)
    log = logging.getLogger("deepseek_ds")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.handlers = [file_handler]
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(console)
    ds_logger = deepspeed.utils.logger
    for h in ds_logger.handlers:  # rank 0 passes DeepSpeed's warnings on; the other ranks only its errors
        h.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
        h.addFilter(_not_noise)
    ds_logger.addHandler(file_handler)
    # DeepSpeed's own collectives call an API torch deprecated: nothing a user can act on, once per rank.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    return log


def log_failure_to_file(message: str) -> None:
    """Put what ended this rank into its own logs/rankN.log (the console has it already), for post-mortems."""
    log = logging.getLogger("deepseek_ds")
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


# DeepSpeed warnings that say nothing to a user of this toolkit: the engine reads the rate once before
# start_lr_schedule() takes the scheduler's first step.
_NOISE = ("Attempting to get learning rate from scheduler before it has started",)


def _not_noise(record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in _NOISE)
