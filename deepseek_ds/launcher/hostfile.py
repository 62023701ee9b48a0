"""Parse and validate DeepSpeed hostfiles and --include/--exclude filters.

Accepts what `deepspeed --hostfile` accepts (deepspeed.launcher.runner: `_parse_hostfile`,
`parse_resource_filter`) and resolves filters to the same slots, but reports every mistake with the
line, host or slot at fault and how to fix it, instead of DeepSpeed's bare ValueError or IndexError.
It is also a little stricter where DeepSpeed would silently misread a file: `slots=0`, `slots=8x`
(DeepSpeed reads 8) and host names containing the filter separators `@ : ,`.

Format, one host per line (MPI style, also what OpenMPI's mpirun reads):
    node-0 slots=8      # slots = processes (GPUs) to start on that host
    # comment lines and blank lines are ignored
Filters: NODE_SPEC[@NODE_SPEC...], NODE_SPEC = HOST[:SLOT[,SLOT...]], e.g. "node-0@node-1:0,2".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from deepseek_ds.utils.errors import UserError

_ENTRY = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S*)(?P<rest>.*)$")
# OpenMPI hostfiles may carry more key=value fields (max_slots=16); DeepSpeed ignores them, so do we.
_EXTRA_FIELD = re.compile(r"^\S+=\S*$")
_FILTER_SEPARATORS = "@:,"


class HostfileError(UserError):
    """A hostfile or --include/--exclude filter that DeepSpeed would reject or misread."""


@dataclass(frozen=True)
class HostEntry:
    name: str
    slots: int
    line: int  # 1-based line number in the hostfile, for messages


@dataclass(frozen=True)
class Hostfile:
    source: str  # path (or "<text>") named in error messages
    entries: tuple[HostEntry, ...]

    @property
    def hosts(self) -> list[str]:
        return [e.name for e in self.entries]

    def slots_of(self, host: str) -> int:
        for entry in self.entries:
            if entry.name == host:
                return entry.slots
        raise KeyError(host)


def read_hostfile(path: str | Path) -> Hostfile:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HostfileError(f"hostfile {path} does not exist; create it with one 'HOST slots=N' line per "
                            f"host (see hostfiles/4node)") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise HostfileError(f"hostfile {path} cannot be read: {err}") from None
    return parse_hostfile(text, source=str(path))


def parse_hostfile(text: str, source: str = "<text>") -> Hostfile:
    entries: list[HostEntry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        match = _ENTRY.match(line)
        if match is None:
            raise HostfileError(f"{where}: '{line}' is not 'HOST slots=N' (e.g. 'node-0 slots=8'); "
                                f"write 'slots=N' with no spaces around '='")
        host, slots_text = match["host"], match["slots"]
        _check_rest(match["rest"], where)
        if not slots_text.isdigit() or int(slots_text) < 1:
            raise HostfileError(f"{where}: host '{host}' has slots={slots_text}; slots must be a whole number "
                                f">= 1 (the number of GPUs to use on that host)")
        bad = [c for c in _FILTER_SEPARATORS if c in host]
        if bad:
            raise HostfileError(f"{where}: host name '{host}' contains '{bad[0]}', which --include/--exclude "
                                f"use as a separator; use the host's plain name or an ssh config alias")
        if host in seen:
            raise HostfileError(f"{where}: host '{host}' is listed again (first on line {seen[host]}); "
                                f"keep one line per host and put all its slots there")
        seen[host] = number
        entries.append(HostEntry(name=host, slots=int(slots_text), line=number))
    if not entries:
        raise HostfileError(f"{source} lists no hosts; add one 'HOST slots=N' line per host (e.g. 'node-0 slots=8')")
    return Hostfile(source=source, entries=tuple(entries))


def _check_rest(rest: str, where: str) -> None:
    """Allow trailing `key=value` fields and a `# comment` after slots=N; nothing else."""
    fields = rest.split("#", 1)[0].split()
    for field in fields:
        if not _EXTRA_FIELD.match(field):
            raise HostfileError(f"{where}: unexpected '{field}' after slots=N; only 'key=value' fields "
                                f"(e.g. max_slots=16) or a '# comment' may follow")


def select_slots(hostfile: Hostfile, include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """Resolve --include/--exclude to {host: [slot, ...]} in hostfile order, as DeepSpeed does."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive; use one of them")
    pool = {e.name: list(range(e.slots)) for e in hostfile.entries}
    if not include and not exclude:
        return pool
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    requested = _parse_filter(flag, spec, hostfile)
    if include:
        # A bare HOST means all of its slots.
        chosen = {host: (slots or pool[host]) for host, slots in requested.items()}
    else:
        chosen = {host: _remaining(slots, requested.get(host)) for host, slots in pool.items()}
    selected = {host: chosen[host] for host in hostfile.hosts if chosen.get(host)}
    if not selected:
        raise HostfileError(f"{flag} '{spec}' leaves no slots to run on; keep at least one host of "
                            f"{hostfile.source}")
    return selected


def _remaining(slots: list[int], excluded: list[int] | None) -> list[int]:
    """Slots left after --exclude: None leaves the host alone, [] (a bare HOST) removes all of it."""
    if excluded is None:
        return slots
    return [s for s in slots if excluded and s not in excluded]


def _parse_filter(flag: str, spec: str, hostfile: Hostfile) -> dict[str, list[int]]:
    """NODE_SPEC[@NODE_SPEC...] -> {host: sorted unique slots}; [] means the whole host."""
    requested: dict[str, list[int]] = {}
    for node_spec in spec.split("@"):
        if not node_spec:
            raise HostfileError(f"{flag} '{spec}': empty host between '@' separators; "
                                f"write HOST[:SLOT,...]@HOST[:SLOT,...]")
        host, colon, slot_list = node_spec.partition(":")
        if host not in hostfile.hosts:
            raise HostfileError(f"{flag} '{spec}': host '{host}' is not in {hostfile.source} "
                                f"(hosts: {', '.join(hostfile.hosts)})")
        slots: list[int] = []
        if colon:
            for slot_text in slot_list.split(","):
                if not slot_text.isdigit():
                    raise HostfileError(f"{flag} '{spec}': slot '{slot_text}' of host '{host}' is not a "
                                        f"slot number; write HOST:0,1 (one ':' per host, slots separated by ',')")
                slot = int(slot_text)
                if slot >= hostfile.slots_of(host):
                    raise HostfileError(f"{flag} '{spec}': host '{host}' has slots 0-{hostfile.slots_of(host) - 1} "
                                        f"in {hostfile.source}, not slot {slot}")
                slots.append(slot)
        # DeepSpeed merges repeated hosts: "a:0@a:1" is "a:0,1".
        requested[host] = sorted(set(requested.get(host, []) + slots))
    return requested


def count_slots(path: str | Path, include: str = "", exclude: str = "") -> int:
    """The ranks `deepspeed --hostfile PATH [--include/--exclude]` starts: the selected slots of every host."""
    return sum(len(slots) for slots in select_slots(read_hostfile(path), include, exclude).values())
