"""`deepseek-ds preflight`: the command-line face of preflight.py and bandwidth.py. Exit status 0 when every check
passes, 1 on a failed check, 2 on a bad hostfile or filter (a HostfileError, reported by the entry point)."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepseek_ds.launcher import bandwidth
from deepseek_ds.launcher.preflight import (
    DEFAULT_MASTER_PORT,
    JOB,
    Check,
    PreflightOptions,
    Status,
    failed,
    format_report,
    run_preflight,
)
from deepseek_ds.utils.cli_args import add_hostfile, add_master_port, add_slot_filters, port, spellings

EXIT_OK, EXIT_FAILED = 0, 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "preflight", help="check every host of a hostfile before a multi-node launch",
        description="Check ssh, versions, GPUs vs slots, InfiniBand, network interfaces, the master port and "
                    "the checkpoint directory on every host of a DeepSpeed hostfile, in parallel. Prints a "
                    "PASS/FAIL table with a fix for each failure; exits 1 on any failure, 2 on a bad hostfile.")
    add_hostfile(parser, type=Path, required=True, help="DeepSpeed hostfile ('HOST slots=N' lines)")
    add_slot_filters(parser)
    add_master_port(parser, default=DEFAULT_MASTER_PORT,
                    help=f"port the first host must have free (deepspeed --master_port; default {DEFAULT_MASTER_PORT})")
    parser.add_argument(*spellings("--master_addr"), default="",
                        help="address of the first host for the bandwidth launch (deepspeed --master_addr); "
                             "default: what DeepSpeed infers, the first of 'hostname -I' there")
    parser.add_argument(*spellings("--checkpoint-dir"),
                        help="directory every host must be able to write (checkpoint.dir; default: not checked)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds per host before it counts as failed (default 10)")
    parser.add_argument(*spellings("--ssh_port"), type=port,
                        help="sshd port on the hosts (deepspeed --ssh_port; default: ssh's own)")
    parser.add_argument(*spellings("--allow-cpu"), action="store_true",
                        help="CPU-only hosts (test clusters): report missing GPUs/InfiniBand as WARN/SKIP, not FAIL")
    parser.add_argument(*spellings("--no_ssh_check"), action="store_true",
                        help="the launch passes deepspeed --no_ssh_check (as deepseek-ds train does for a local-only "
                             "hostfile): do not require `ssh localhost`")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also launch an all-reduce across the hosts with deepspeed and print the bus GB/s")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = PreflightOptions(hostfile=args.hostfile, include=args.include, exclude=args.exclude,
                               master_port=args.master_port, master_addr=args.master_addr,
                               checkpoint_dir=args.checkpoint_dir,
                               timeout=args.timeout, allow_cpu=args.allow_cpu, ssh_port=args.ssh_port,
                               no_ssh_check=args.no_ssh_check)
    job, checks = run_preflight(options)
    if args.bandwidth:
        checks.append(_bandwidth_check(options, list(job.slots), checks))
    print(format_report(checks), flush=True)
    return EXIT_FAILED if failed(checks) else EXIT_OK


def _bandwidth_check(options: PreflightOptions, hosts: list[str], checks: list[Check]) -> Check:
    if failed(checks):
        return Check(JOB, "bandwidth", Status.SKIP, "not run: fix the failures above first")
    print(f"preflight: measuring all-reduce bandwidth (up to {bandwidth.LAUNCH_TIMEOUT_S} s) ...", flush=True)
    command = bandwidth.bandwidth_command(options, hosts)
    result = bandwidth.measure(command, options.cwd)
    if result.ok:
        return Check(JOB, "bandwidth", Status.PASS, result.detail)
    return Check(JOB, "bandwidth", Status.FAIL, result.detail,
                 f"the checks passed but a real launch failed: run '{' '.join(command)}' and read its output")
