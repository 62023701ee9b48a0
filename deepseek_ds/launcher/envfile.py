"""The environment DeepSpeed's multi-node launcher exports on every host.

`deepspeed --hostfile` reads `~/.deepspeed_env` and then `./.deepspeed_env` (the name can be changed
with DS_ENV_FILE) and turns each line into `export KEY=VALUE;` in front of the command it runs on
every node. It splits each line at the first '=' and nothing else, so:
  - a blank line, or any line without '=', crashes the launcher (ValueError: not enough values);
  - a comment line containing '=' becomes `export # ...` and the shell then ignores the REST of the
    remote command line: the job starts nothing and still exits 0.
The commented source we keep in the repo (launch/nccl.env) is therefore rendered into a bare
`.deepspeed_env` by the launch wrappers, and preflight rejects the two mistakes above. Its values may be
secrets (an API key passed with `--env`), so the wrappers write it owner-only (mode 0600, whatever the umask)
and remove it when the launcher exits: DeepSpeed reads it once, as it starts, and it is not left behind.
Interface/HCA lists follow NCCL's syntax (comma-separated prefixes, '^' excludes, '=' means exact).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deepseek_ds.utils.errors import UserError

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# With a CUDA accelerator DeepSpeed also exports the launcher's own NCCL* variables to every node.
LAUNCHER_EXPORTED_PREFIXES = ("NCCL",)


class EnvFileError(UserError):
    """A .deepspeed_env line that would crash DeepSpeed's launcher or silently break the launch."""


@dataclass(frozen=True)
class EnvFile:
    path: Path
    values: dict[str, str]


def deepspeed_env_paths(environ: Mapping[str, str], cwd: Path) -> list[Path]:
    """The files DeepSpeed's runner reads, in its order (later values win), that exist."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    home = Path(environ.get("HOME", str(Path.home())))
    paths = [home / name, cwd / name]
    return [p for p in paths if p.is_file()]


def parse_deepspeed_env(text: str, source: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{source}:{number}"
        if not line.strip():
            raise EnvFileError(f"{where}: blank line; DeepSpeed's launcher crashes on it "
                               f"(every line must be KEY=VALUE): delete it")
        if line.lstrip().startswith("#"):
            raise EnvFileError(f"{where}: comment line; DeepSpeed exports it as 'export {line.strip()}', which "
                               f"comments out the remote launch command: keep comments in launch/nccl.env and "
                               f"let the launch wrappers render this file")
        key, sep, value = line.partition("=")
        if not sep or not _KEY.match(key.strip()):
            raise EnvFileError(f"{where}: '{line}' is not KEY=VALUE with a shell variable name as KEY")
        values[key.strip()] = value.strip()
    return values


def read_deepspeed_env(path: Path) -> EnvFile:
    return EnvFile(path=path, values=parse_deepspeed_env(path.read_text(), str(path)))


def launch_environment(files: list[EnvFile], environ: Mapping[str, str]) -> dict[str, str]:
    """What every node will see for the variables preflight checks (files override the launcher's)."""
    merged = {k: v for k, v in environ.items() if k.startswith(LAUNCHER_EXPORTED_PREFIXES)}
    for env_file in files:
        merged.update(env_file.values)
    return merged


def nccl_select(spec: str, available: list[str]) -> list[str]:
    """Names NCCL would pick from `available` for a NCCL_SOCKET_IFNAME / NCCL_IB_HCA value.

    "eth,ib" selects names starting with eth or ib, "=eth0" exactly eth0, "^docker" everything but
    names starting with docker. An HCA entry may name a port ("mlx5_0:1"); ports are ignored here.
    """
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    wanted = [item.split(":")[0] for item in spec.split(",") if item]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [name for name in available if hit(name) != exclude]


def gloo_missing(spec: str, available: list[str]) -> list[str]:
    """Names in a GLOO_SOCKET_IFNAME value (comma-separated exact interface names) not in `available`."""
    return [name for name in spec.split(",") if name and name not in available]
