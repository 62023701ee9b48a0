"""Run the probe (probe.py) on many hosts at once over ssh, each bounded by a timeout.

ssh runs with BatchMode (a password or host-key prompt fails instead of hanging, exactly as it would
under pdsh) and ConnectTimeout; the whole call is also killed after the timeout, which covers a host
that accepts the connection and then stalls. ssh's own errors are turned into a cause and a fix.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from deepseek_ds.launcher import probe

LOCAL_HOSTS = ("localhost", "127.0.0.1")  # DeepSpeed runs a single-host job on these without ssh
SSH_FAILED = 255  # ssh's exit status for its own failures (the remote command's status otherwise)
COMMAND_NOT_FOUND = 127
MAX_PARALLEL_SSH = 256  # a large cluster's hosts in few rounds, yet far below sshd/ulimit trouble

# (text in ssh's stderr, cause, fix); {host} is filled in.
_SSH_ERRORS = (
    ("Could not resolve hostname", "host name does not resolve",
     "add {host} to DNS or /etc/hosts, or give it an ssh alias (Host {host} / HostName ADDRESS in ~/.ssh/config)"),
    ("Connection refused", "ssh connection refused (sshd not running or on another port)",
     "start sshd on {host} (systemctl start ssh), or pass --ssh-port if it listens elsewhere"),
    ("Permission denied", "ssh key not accepted",
     "set up passwordless ssh from this machine: ssh-copy-id {host} (pdsh cannot type passwords)"),
    ("Host key verification failed", "host key unknown or changed",
     "accept the key once with 'ssh {host} true' (or fix the stale line in ~/.ssh/known_hosts)"),
    ("No route to host", "no route to host", "check that {host} is up and on this network (ping {host})"),
    ("Network is unreachable", "network unreachable", "check that {host} is up and on this network (ping {host})"),
    ("timed out", "ssh connection timed out",
     "check that {host} is up and that a firewall does not drop port 22; raise --timeout if it is only slow"),
)


@dataclass(frozen=True)
class ProbeResult:
    host: str
    seconds: float
    facts: dict[str, object] | None  # None when the probe did not run
    error: str = ""  # why facts is None
    fix: str = ""
    stage: str = "ssh"  # "ssh" or "python": which step failed


def probe_command(host: str, python: str, probe_args: list[str], timeout: float, ssh_port: int | None) -> list[str]:
    remote = shlex.join([python, "-", *probe_args])
    if host in LOCAL_HOSTS:
        return ["bash", "-c", remote]
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}"]
    if ssh_port is not None:
        ssh += ["-p", str(ssh_port)]
    return ssh + [host, remote]


def run_probe(host: str, python: str, probe_args: list[str], timeout: float,
              ssh_port: int | None = None) -> ProbeResult:
    command = probe_command(host, python, probe_args, timeout, ssh_port)
    source = Path(probe.__file__).read_text()
    start = time.monotonic()
    try:
        out = subprocess.run(command, input=source, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ProbeResult(host, time.monotonic() - start, None, f"no answer within {timeout:g} s",
                           f"check that {host} is up and not overloaded; raise --timeout if it is only slow")
    seconds = time.monotonic() - start
    if out.returncode == SSH_FAILED and host not in LOCAL_HOSTS:
        cause, fix = _ssh_failure(host, out.stderr)
        return ProbeResult(host, seconds, None, cause, fix)
    if out.returncode == COMMAND_NOT_FOUND:
        return ProbeResult(host, seconds, None, f"{python} not found on {host}",
                           f"install the same Python environment at {python} on {host}: DeepSpeed runs "
                           f"that exact interpreter on every host", stage="python")
    for line in out.stdout.splitlines():
        if line.startswith(probe.MARKER):
            return ProbeResult(host, seconds, json.loads(line[len(probe.MARKER):]))
    return ProbeResult(host, seconds, None, f"probe failed (exit {out.returncode}): {_last_line(out.stderr)}",
                       f"run '{shlex.join(command)} < {probe.__file__}' to see the whole error", stage="python")


def ssh_works(host: str, timeout: float, ssh_port: int | None = None) -> tuple[bool, str]:
    """Whether `ssh HOST true` succeeds without a password, as DeepSpeed's launcher checks (for localhost too);
    (False, why) otherwise."""
    command = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}"]
    command += ["-p", str(ssh_port)] if ssh_port is not None else []
    try:
        out = subprocess.run([*command, host, "true"], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return False, "no ssh client on this machine"
    except subprocess.TimeoutExpired:
        return False, f"no answer within {timeout:g} s"
    return out.returncode == 0, _last_line(out.stderr)


def _ssh_failure(host: str, stderr: str) -> tuple[str, str]:
    for needle, cause, fix in _SSH_ERRORS:
        if needle in stderr:
            return cause, fix.format(host=host)
    return f"ssh failed: {_last_line(stderr)}", f"run 'ssh -o BatchMode=yes {host} true' to see why"


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def probe_hosts(hosts: list[str], python: str, args_for: dict[str, list[str]], timeout: float,
                ssh_port: int | None = None) -> dict[str, ProbeResult]:
    """Probe the hosts in parallel: the wall time stays about one timeout however many hosts fail."""
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SSH, len(hosts))) as pool:
        futures = {h: pool.submit(run_probe, h, python, args_for.get(h, []), timeout, ssh_port) for h in hosts}
        return {h: f.result() for h, f in futures.items()}
