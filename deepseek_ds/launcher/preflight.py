"""Preflight: is every host of a hostfile ready for `deepspeed --hostfile`?

Probes all hosts in parallel (remote.py runs probe.py over ssh) and judges the facts: ssh, the
Python/torch/DeepSpeed versions (the same everywhere), GPUs vs the slots used, InfiniBand ports, the
network interfaces named in the exported environment, the master port on the first host and the
checkpoint directory. Each check becomes a row with PASS/WARN/SKIP/FAIL and, when something is
wrong, the fix. The report is the product: the caller prints it and exits non-zero on any FAIL.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from deepseek_ds.launcher import envfile, remote
from deepseek_ds.launcher.hostfile import read_hostfile, select_slots

JOB = "*"  # the host column of checks about the job as a whole
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's default --master_port


class Status(str, Enum):
    PASS = "PASS"
    WARN = "WARN"  # works, but probably not what you want on a GPU cluster
    SKIP = "SKIP"  # not applicable here
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    host: str
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class PreflightOptions:
    hostfile: Path
    include: str = ""
    exclude: str = ""
    master_port: int = DEFAULT_MASTER_PORT
    master_addr: str = ""  # as deepspeed --master_addr; empty: DeepSpeed asks the first host (hostname -I)
    checkpoint_dir: str | None = None
    # What checkpoint_dir holds, as the report names it: "checkpoint" (checkpoint.dir), or "output" for the dataset
    # directory of `data prepare --hostfile`.
    dir_role: str = "checkpoint"
    timeout: float = 10.0
    allow_cpu: bool = False  # CPU-only hosts (test clusters): no GPUs / no InfiniBand are not failures
    ssh_port: int | None = None
    no_ssh_check: bool = False  # the launch passes deepspeed --no_ssh_check (deepseek-ds train does on localhost)
    # DeepSpeed's pdsh launcher runs the launching interpreter's path on every host, so that is the
    # Python to probe there.
    python: str = sys.executable
    cwd: Path = field(default_factory=Path.cwd)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


@dataclass(frozen=True)
class Job:
    """What the options resolve to: the hosts and slots DeepSpeed would use and their environment."""
    slots: dict[str, list[int]]
    env: dict[str, str]


def run_preflight(options: PreflightOptions) -> tuple[Job, list[Check]]:
    """Raises HostfileError for a bad hostfile or filter: nothing can be checked without hosts."""
    hostfile = read_hostfile(options.hostfile)
    slots = select_slots(hostfile, options.include, options.exclude)
    env_check, env = _environment(options)
    job = Job(slots=slots, env=env)
    hosts = list(slots)
    args_for = {h: (["--checkpoint-dir", options.checkpoint_dir] if options.checkpoint_dir else []) for h in hosts}
    args_for[hosts[0]] += ["--port", str(options.master_port)]
    if options.checkpoint_dir and len(hosts) > 1:
        args_for[hosts[0]] += ["--share-token", uuid.uuid4().hex]
    results = remote.probe_hosts(hosts, options.python, args_for, options.timeout, options.ssh_port)

    checks = [Check(JOB, "hostfile", Status.PASS, f"{options.hostfile}: {_count(len(hosts), 'host')}, "
                    f"{_count(sum(len(s) for s in slots.values()), 'slot')}"), env_check]
    reference = next((results[h] for h in hosts if results[h].facts is not None), None)
    for host in hosts:
        checks += _host_checks(job, options, results[host], reference, is_first=host == hosts[0])
    token = ((results[hosts[0]].facts or {}).get("checkpoint_dir") or {}).get("token")
    if token and token["path"]:
        checks.append(_shared_checkpoint_dir(options, hosts, results, token["path"]))
    return job, checks


def _shared_checkpoint_dir(options: PreflightOptions, hosts: list[str], results: dict[str, remote.ProbeResult],
                           token_path: str) -> Check:
    """Every other reachable host reads back the token file the first host wrote (a second round of probes, after
    the first), then the first host removes it (a third)."""
    readers = [h for h in hosts[1:] if results[h].facts is not None]
    seen = remote.probe_hosts(readers, options.python, {h: ["--expect-token", token_path] for h in readers},
                              options.timeout, options.ssh_port) if readers else {}
    remote.probe_hosts(hosts[:1], options.python, {hosts[0]: ["--remove-token", token_path]}, options.timeout,
                       options.ssh_port)
    return judge_shared(hosts[0], options.checkpoint_dir, token_path, seen, options.dir_role)


def judge_shared(first: str, checkpoint_dir: str, token_path: str, seen: dict[str, remote.ProbeResult],
                 role: str = "checkpoint") -> Check:
    """PASS when every host read the first host's token file back; FAIL naming those that did not."""
    blind = {h: (r.facts["token"]["detail"] if r.facts else r.error) for h, r in seen.items()
             if not (r.facts and r.facts["token"]["seen"])}
    if blind:
        why = "; ".join(f"{h}: {detail}" for h, detail in blind.items())
        lost = ("a checkpoint would lack the shards of the hosts rank 0 cannot see" if role == "checkpoint" else
                f"the {role} would lack the files of the hosts the first cannot see")
        return Check(JOB, f"{role} shared", Status.FAIL,
                     f"{_count(len(blind), 'host')} of {len(seen) + 1} do not see the file {first} wrote in "
                     f"{os.path.dirname(token_path)} ({why}): {checkpoint_dir} is not one directory shared by "
                     f"every host, so {lost}",
                     f"mount the same shared filesystem (NFS, Lustre, GPFS, ...) at {checkpoint_dir} on every host, "
                     + ("or point checkpoint.dir at a directory on one" if role == "checkpoint" else
                        f"or write the {role} to a directory on one"))
    return Check(JOB, f"{role} shared", Status.PASS,
                 f"{_count(len(seen), 'other host')} read back the file {first} wrote in {os.path.dirname(token_path)}")


def _environment(options: PreflightOptions) -> tuple[Check, dict[str, str]]:
    paths = envfile.deepspeed_env_paths(options.environ, options.cwd)
    try:
        files = [envfile.read_deepspeed_env(p) for p in paths]
    except envfile.EnvFileError as err:
        return Check(JOB, "env file", Status.FAIL, str(err), "keep comments and blank lines in launch/nccl.env "
                     "and let the launch/*.sh wrappers render .deepspeed_env from it"), \
            envfile.launch_environment([], options.environ)
    env = envfile.launch_environment(files, options.environ)
    if not files:
        return Check(JOB, "env file", Status.PASS, "no .deepspeed_env in ~ or . (optional: the launch/*.sh "
                     "wrappers write one from launch/nccl.env)"), env
    names = ", ".join(str(f.path) for f in files)
    return Check(JOB, "env file", Status.PASS, f"{names}: {len(env)} variables exported to every host"), env


def _host_checks(job: Job, options: PreflightOptions, result: remote.ProbeResult,
                 reference: remote.ProbeResult | None, is_first: bool) -> list[Check]:
    host = result.host
    if result.facts is None:
        if result.stage == "ssh":
            return [Check(host, "ssh", Status.FAIL, result.error, result.fix)]
        return [_ssh_passed(result, options), Check(host, "python", Status.FAIL, result.error, result.fix)]
    facts = result.facts
    checks = [_ssh_passed(result, options),
              _versions(host, facts, reference),
              _gpus(host, facts, job.slots[host], options),
              _infiniband(host, facts, job.env, options.allow_cpu),
              _interfaces(host, facts, job.env)]
    if is_first:
        checks.append(_master(host, facts, options))
    if options.checkpoint_dir:
        checks.append(_checkpoint_dir(host, facts, options.dir_role))
    return checks


def _ssh_passed(result: remote.ProbeResult, options: PreflightOptions) -> Check:
    host = result.host
    if host not in remote.LOCAL_HOSTS:
        return Check(host, "ssh", Status.PASS, f"connected, probed in {result.seconds:.1f} s")
    # A single local host runs without pdsh, but `deepspeed --hostfile` first runs `ssh HOST hostname` (and
    # `hostname -I` without --master_addr) even then: check what the launch will do.
    if options.no_ssh_check:
        return Check(host, "ssh", Status.PASS, f"local; the launch skips DeepSpeed's ssh check (probed in "
                     f"{result.seconds:.1f} s)")
    works, why = remote.ssh_works(host, options.timeout, options.ssh_port)
    if works:
        return Check(host, "ssh", Status.PASS, f"local; `ssh {host}` works, as DeepSpeed's hostfile launch checks")
    return Check(host, "ssh", Status.FAIL, f"local, but `ssh {host}` fails ({why}) and `deepspeed --hostfile` "
                 "checks it", "pass --no_ssh_check --master_addr 127.0.0.1 to deepspeed (deepseek-ds train does this "
                 "for a local-only hostfile; then run preflight with --no-ssh-check), launch without a hostfile "
                 "(--num_gpus N), or enable passwordless ssh to it")


def _version_text(facts: dict) -> str:
    packages = facts["packages"]
    return ", ".join([f"python {facts['python']}"] + [f"{name} {version or 'MISSING'}"
                                                      for name, version in packages.items()])


def _versions(host: str, facts: dict, reference: remote.ProbeResult | None) -> Check:
    missing = [name for name, version in facts["packages"].items() if version is None]
    if missing:
        return Check(host, "versions", Status.FAIL, f"{', '.join(missing)} not installed in {facts['executable']}",
                     f"install the same versions as the other hosts into {facts['executable']} on {host}")
    ours, theirs = _version_text(facts), _version_text(reference.facts) if reference else ""
    if reference and ours != theirs:
        return Check(host, "versions", Status.FAIL, f"{ours}; {reference.host} has {theirs}",
                     "install the same Python, torch and DeepSpeed on every host (mismatched builds hang or "
                     "crash in the first collective)")
    return Check(host, "versions", Status.PASS, ours)


def _gpus(host: str, facts: dict, slots: list[int], options: PreflightOptions) -> Check:
    count, why = facts["gpus"]["count"], facts["gpus"]["error"]
    # The launcher maps slot k to GPU k (CUDA_VISIBLE_DEVICES), so the highest slot must exist.
    needed = max(slots) + 1
    if not count:
        reason = why or "0 GPUs"
        if options.allow_cpu:
            return Check(host, "gpus", Status.WARN, f"cpu: {reason}; {_count(len(slots), 'rank')} run on the CPU "
                         f"accelerator (allowed by --allow-cpu)")
        return Check(host, "gpus", Status.FAIL, f"no GPUs ({reason}) for {_count(len(slots), 'slot')}",
                     f"install or repair the NVIDIA driver on {host} until nvidia-smi lists its GPUs, or pass "
                     f"--allow-cpu for a CPU-only test cluster")
    if count < needed:
        return Check(host, "gpus", Status.FAIL, f"{count} GPUs, but slot {needed - 1} is used",
                     f"set '{host} slots={count}' in {options.hostfile} (or --exclude the missing slots), or "
                     f"find out why nvidia-smi on {host} shows only {count}")
    return Check(host, "gpus", Status.PASS, f"{_count(count, 'GPU')}, {_count(len(slots), 'slot')} used")


def _infiniband(host: str, facts: dict, env: dict[str, str], allow_cpu: bool) -> Check:
    devices: dict[str, list[dict[str, str]]] = facts["infiniband"]
    if env.get("NCCL_IB_DISABLE") == "1":
        return Check(host, "infiniband", Status.SKIP, "NCCL_IB_DISABLE=1: NCCL uses TCP sockets")
    if not devices:
        if allow_cpu:
            return Check(host, "infiniband", Status.SKIP, "no InfiniBand devices (fine for a CPU test cluster)")
        return Check(host, "infiniband", Status.WARN, "no devices in /sys/class/infiniband: NCCL falls back to "
                     "TCP sockets, which is slow between hosts",
                     f"load the IB/RoCE driver on {host} (ibv_devinfo lists the HCAs), or set NCCL_IB_DISABLE=1 "
                     f"in launch/nccl.env if the cluster has no InfiniBand")
    hca = env.get("NCCL_IB_HCA", "")
    chosen = envfile.nccl_select(hca, list(devices)) if hca else list(devices)
    if not chosen:
        return Check(host, "infiniband", Status.FAIL, f"NCCL_IB_HCA={hca} matches none of {', '.join(devices)}",
                     f"set NCCL_IB_HCA in launch/nccl.env to HCAs every host has (ibv_devinfo -l on {host})")
    ports = [(f"{d}:{p['port']}", p) for d in chosen for p in devices[d]]
    active = [name for name, p in ports if p["state"].endswith("ACTIVE")]
    inactive = [f"{name} ({p['state'].split(':')[-1].strip()})" for name, p in ports if name not in active]
    if not active:
        return Check(host, "infiniband", Status.FAIL, f"no ACTIVE port: {', '.join(inactive)}",
                     f"check cables and the subnet manager on {host} (ibstat); NCCL would fall back to sockets")
    if inactive:
        return Check(host, "infiniband", Status.WARN, f"ACTIVE: {', '.join(active)}; not: {', '.join(inactive)}",
                     "check those ports (ibstat), or leave them out of NCCL_IB_HCA in launch/nccl.env")
    layers = sorted({p["link_layer"] for _, p in ports})
    return Check(host, "infiniband", Status.PASS, f"{', '.join(active)} ACTIVE ({'/'.join(layers)})")


def _interfaces(host: str, facts: dict, env: dict[str, str]) -> Check:
    available: list[str] = facts["interfaces"]
    named = {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if env.get(k)}
    if not named:
        return Check(host, "interfaces", Status.SKIP, "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME not set: NCCL and "
                     "gloo pick an interface themselves")
    problems = []
    if "NCCL_SOCKET_IFNAME" in named and not envfile.nccl_select(named["NCCL_SOCKET_IFNAME"], available):
        problems.append(f"NCCL_SOCKET_IFNAME={named['NCCL_SOCKET_IFNAME']} matches no interface")
    missing = envfile.gloo_missing(named.get("GLOO_SOCKET_IFNAME", ""), available)
    if missing:
        problems.append(f"GLOO_SOCKET_IFNAME names missing {', '.join(missing)}")
    if problems:
        return Check(host, "interfaces", Status.FAIL, f"{'; '.join(problems)} (has: {', '.join(available)})",
                     "name an interface every host has (ip -br link) in launch/nccl.env / .deepspeed_env")
    return Check(host, "interfaces", Status.PASS, ", ".join(f"{k}={v}" for k, v in named.items()))


def _master(host: str, facts: dict, options: PreflightOptions) -> Check:
    port = options.master_port
    if not facts["port"]["free"]:
        return Check(host, "master", Status.FAIL, f"port {port} on {host}: {facts['port']['error']}",
                     f"stop what holds it (ss -ltnp 'sport = :{port}' on {host}) or pick another port: "
                     f"deepspeed --master_port P (preflight --master-port P)")
    if options.master_addr or host in remote.LOCAL_HOSTS:
        return Check(host, "master", Status.PASS, f"port {port} free")
    if not facts["first_address"]:
        return Check(host, "master", Status.FAIL, f"port {port} free, but 'hostname -I' on {host} gives no address",
                     f"pass the address of {host} that the other hosts reach: deepspeed --master_addr ADDR "
                     f"(preflight --master-addr ADDR)")
    return Check(host, "master", Status.PASS, f"port {port} free; DeepSpeed will use address "
                 f"{facts['first_address']} (first of 'hostname -I'; --master_addr overrides)")


def _checkpoint_dir(host: str, facts: dict, role: str) -> Check:
    status = facts["checkpoint_dir"]
    if status["ok"]:
        return Check(host, f"{role} dir", Status.PASS, status["detail"])
    return Check(host, f"{role} dir", Status.FAIL, status["detail"],
                 f"make it writable for this user on {host}, on storage every host mounts at the same path"
                 + (" (checkpoint.dir in the recipe)" if role == "checkpoint" else ""))


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status is Status.FAIL]


def format_report(checks: list[Check]) -> str:
    """A table, with each WARN/FAIL's fix on the line below it, and a one-line verdict."""
    host_w = max(len("HOST"), *(len(c.host) for c in checks))
    name_w = max(len("CHECK"), *(len(c.name) for c in checks))
    lines = [f"{'HOST':<{host_w}}  {'CHECK':<{name_w}}  STATUS  DETAIL"]
    indent = " " * (host_w + name_w + 12)  # continuation lines start under DETAIL
    for c in checks:
        first, *more = c.detail.splitlines() or [""]
        lines.append(f"{c.host:<{host_w}}  {c.name:<{name_w}}  {c.status.value:<6}  {first}")
        lines += [indent + line for line in more]
        if c.fix and c.status in (Status.FAIL, Status.WARN):
            lines.append(f"{indent}fix: {c.fix}")
    bad = failed(checks)
    if bad:
        hosts = sorted({c.host for c in bad})
        lines.append(f"preflight FAILED: {_count(len(bad), 'check')} on {', '.join(hosts)}")
    else:
        warnings = sum(c.status is Status.WARN for c in checks)
        lines.append("preflight passed" + (f" ({_count(warnings, 'warning')})" if warnings else ""))
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
