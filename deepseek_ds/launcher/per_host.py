"""One process on each host of a hostfile: how `data prepare --hostfile` starts its per-host tokenizers, after the
same preflight as a training launch and through the same DeepSpeed launcher (pdsh/ssh; one launcher per node under
srun). The process's host index is its RANK (one slot a host: the hosts' order in the hostfile) or SLURM_NODEID."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from deepseek_ds.launcher.hostfile import read_hostfile, select_slots
from deepseek_ds.launcher.preflight import DEFAULT_MASTER_PORT, PreflightOptions, failed, format_report, run_preflight
from deepseek_ds.launcher.remote import LOCAL_HOSTS
from deepseek_ds.launcher.supervise import run_launcher
from deepseek_ds.utils.errors import LaunchError, UserError


@dataclasses.dataclass(frozen=True)
class HostJob:
    """The hosts of a per-host launch: a hostfile with --include/--exclude, or the nodes of the Slurm allocation."""
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    master_port: int | None = None
    ssh_port: int | None = None
    srun: bool = False

    def hosts(self) -> list[str]:
        if self.srun:
            nodes = os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES")
            if not nodes:
                raise UserError("--srun starts one process per node of a Slurm allocation: run it inside one "
                                "(sbatch or salloc), or pass --hostfile")
            return [f"node{k}" for k in range(int(nodes))]
        return list(select_slots(read_hostfile(self.hostfile), self.include, self.exclude))


def runner_command(options: PreflightOptions, hosts: list[str]) -> list[str]:
    """`python -m deepspeed.launcher.runner` with the options' hostfile, filters, ports and master address; the
    caller appends the script (or --module and its name) and its arguments."""
    command = [options.python, "-m", "deepspeed.launcher.runner", "--hostfile", str(options.hostfile),
               "--master_port", str(options.master_port)]
    master_addr = options.master_addr
    if set(hosts) <= set(LOCAL_HOSTS):
        # DeepSpeed starts a local-only job without ssh, yet with a hostfile it still tests
        # `ssh localhost` and asks it for the master address unless told otherwise.
        command.append("--no_ssh_check")
        master_addr = master_addr or "127.0.0.1"
    if master_addr:
        command += ["--master_addr", master_addr]
    if options.include:
        command += ["--include", options.include]
    if options.exclude:
        command += ["--exclude", options.exclude]
    if options.ssh_port is not None:
        command += ["--ssh_port", str(options.ssh_port)]
    return command


def _options(job: HostJob, shared_dir: str) -> PreflightOptions:
    return PreflightOptions(hostfile=Path(job.hostfile), include=job.include, exclude=job.exclude,
                            master_port=job.master_port or DEFAULT_MASTER_PORT, checkpoint_dir=shared_dir,
                            dir_role="output", allow_cpu=True, ssh_port=job.ssh_port,
                            no_ssh_check=set(job.hosts()) <= set(LOCAL_HOSTS))  # as runner_command launches them


def check_hosts(job: HostJob, shared_dir: str) -> list[str]:
    """Preflight for a launch that needs no GPU (missing GPUs and InfiniBand are not failures) and that writes into
    `shared_dir` from every host (checked to be one directory seen by all); returns the hosts, or raises LaunchError
    after printing the report of a failed check. Under srun the hosts check the shared directory themselves."""
    if job.srun:
        return job.hosts()
    os.makedirs(shared_dir, exist_ok=True)  # the shared check writes its token file there
    _, checks = run_preflight(_options(job, shared_dir))
    if failed(checks):
        print(format_report(checks), flush=True)
        raise LaunchError(f"preflight failed for {job.hostfile}: fix the checks above, then re-run")
    return job.hosts()


def run_per_host(job: HostJob, shared_dir: str, module: str, args: list[str]) -> int:
    """`python -m module args` once on each host (one slot of each); returns the launcher's exit status."""
    if job.srun:
        # --kill-on-bad-exit: a failed host stops the others, as in launch/slurm.sbatch.
        argv = ["srun", f"--nodes={len(job.hosts())}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                sys.executable, "-m", module, *args]
        return subprocess.run(argv).returncode
    slots = select_slots(read_hostfile(job.hostfile), job.include, job.exclude)
    one_each = dataclasses.replace(_options(job, shared_dir), include="@".join(f"{h}:{s[0]}" for h, s in slots.items()),
                                   exclude="")
    argv = [*runner_command(one_each, list(slots)), "--module", module, *args]
    status, _ = run_launcher(argv, multi_host=len(slots) > 1)
    return status
