"""Facts about one host, gathered on that host for preflight.

Preflight streams this file's source to `ssh HOST PYTHON -` and reads one JSON line back, so it uses
the standard library only (the host needs no deepseek_ds install) and imports neither torch nor
DeepSpeed (versions come from package metadata: a fast probe keeps the timeout meaningful).
It only reports; judging the facts is preflight's job.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import uuid
from importlib import metadata

MARKER = "DSPROBE "  # prefixes the result line, so banners printed by shell start-up files are skipped
PACKAGES = ("torch", "deepspeed")
NVIDIA_SMI_TIMEOUT_S = 20


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def gpu_info() -> dict[str, object]:
    """{"count": N or None, "error": why N is unknown}."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"count": None, "error": "nvidia-smi not found"}
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"count": None, "error": f"nvidia-smi hung for {NVIDIA_SMI_TIMEOUT_S} s"}
    if out.returncode != 0:  # e.g. "No devices were found", or a driver/library mismatch
        lines = (out.stderr or out.stdout).strip().splitlines()
        return {"count": None, "error": lines[-1] if lines else f"nvidia-smi exited with {out.returncode}"}
    return {"count": len(out.stdout.split()), "error": None}


def infiniband_ports(root: str = "/sys/class/infiniband") -> dict[str, list[dict[str, str]]]:
    """{device: [{"port", "state", "link_layer"}]}; state as the kernel writes it, e.g. "4: ACTIVE"."""
    devices: dict[str, list[dict[str, str]]] = {}
    if not os.path.isdir(root):
        return devices
    for device in sorted(os.listdir(root)):
        ports_dir = os.path.join(root, device, "ports")
        ports = []
        for port in sorted(os.listdir(ports_dir)) if os.path.isdir(ports_dir) else []:
            ports.append({"port": port,
                          "state": _read(os.path.join(ports_dir, port, "state")),
                          "link_layer": _read(os.path.join(ports_dir, port, "link_layer"))})
        devices[device] = ports
    return devices


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def port_free(port: int) -> dict[str, object]:
    """Can the rendezvous store bind this port? SO_REUSEADDR as torch's TCPStore sets it, so a port
    only in TIME_WAIT counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            in_use = err.errno == errno.EADDRINUSE
            return {"free": False, "error": "in use" if in_use else str(err)}
    return {"free": True, "error": None}


def first_address() -> str | None:
    """The address DeepSpeed's launcher picks for this host as master when --master_addr is not given."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    addresses = out.stdout.split()
    return addresses[0] if out.returncode == 0 and addresses else None


def checkpoint_dir_status(path: str) -> dict[str, object]:
    """Write and delete a file in `path`; if it does not exist yet, check that it can be created."""
    if os.path.isdir(path):
        probe = os.path.join(path, f".preflight-{uuid.uuid4().hex}")
        try:
            with open(probe, "w") as f:
                f.write("preflight\n")
            os.remove(probe)
        except OSError as err:
            return {"ok": False, "detail": f"cannot write in {path}: {err.strerror}"}
        return {"ok": True, "detail": f"{path} is writable"}
    if os.path.exists(path):
        return {"ok": False, "detail": f"{path} exists and is not a directory"}
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
        return {"ok": True, "detail": f"{path} does not exist yet; {parent} is writable, so it can be created"}
    return {"ok": False, "detail": f"{path} does not exist and {parent} is not writable"}


TOKEN_PREFIX = ".preflight-shared-"


def _existing_dir(path: str) -> str:
    """`path`, or its nearest existing ancestor (where it would be created)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def write_token(checkpoint_dir: str, token: str) -> dict[str, object]:
    """On the first host: a file named and filled with `token` in the checkpoint directory (or the directory that
    would hold it), for the other hosts to read back; {"path": where, or None, "detail"}."""
    path = os.path.join(_existing_dir(checkpoint_dir), TOKEN_PREFIX + token)
    try:
        with open(path, "w") as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return {"path": None, "detail": f"cannot write {path}: {err.strerror}"}
    return {"path": path, "detail": f"wrote {path}"}


def read_token(path: str) -> dict[str, object]:
    """On every other host: does it see the first host's token file, with its content? {"seen", "detail"}."""
    token = os.path.basename(path)[len(TOKEN_PREFIX):]
    try:
        with open(path) as f:
            content = f.read()
    except OSError as err:
        return {"seen": False, "detail": f"{path}: {err.strerror}"}
    if content != token:
        return {"seen": False, "detail": f"{path} holds {content[:40]!r}, not the token written"}
    return {"seen": True, "detail": f"read {path}"}


def remove_token(path: str) -> dict[str, object]:
    try:
        os.remove(path)
    except OSError as err:
        return {"removed": False, "detail": f"{path}: {err.strerror}"}
    return {"removed": True, "detail": f"removed {path}"}


def collect(port: int | None, checkpoint_dir: str | None, share_token: str | None = None) -> dict[str, object]:
    facts: dict[str, object] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "packages": package_versions(),
        "gpus": gpu_info(),
        "infiniband": infiniband_ports(),
        "interfaces": sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else [],
    }
    if port is not None:  # asked of the first host only: the one that hosts the rendezvous
        facts["port"] = port_free(port)
        facts["first_address"] = first_address()
    if checkpoint_dir is not None:
        facts["checkpoint_dir"] = checkpoint_dir_status(checkpoint_dir)
        if share_token is not None and facts["checkpoint_dir"]["ok"]:  # asked of the first host only
            facts["checkpoint_dir"]["token"] = write_token(checkpoint_dir, share_token)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, help="check that this TCP port is free")
    parser.add_argument("--checkpoint-dir", help="check that this directory is writable")
    parser.add_argument("--share-token", help="with --checkpoint-dir: write a token file there for other hosts")
    parser.add_argument("--expect-token", metavar="PATH", help="only: read another host's token file back")
    parser.add_argument("--remove-token", metavar="PATH", help="only: remove this host's token file")
    args = parser.parse_args(argv)
    if args.expect_token:
        facts = {"token": read_token(args.expect_token)}
    elif args.remove_token:
        facts = {"token": remove_token(args.remove_token)}
    else:
        facts = collect(args.port, args.checkpoint_dir, args.share_token)
    print(MARKER + json.dumps(facts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
