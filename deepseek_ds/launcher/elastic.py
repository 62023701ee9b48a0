"""Which hosts of a hostfile job are gone, before a restart (`deepseek-ds train --max-restarts N [--elastic]`): each
host the job uses is probed as preflight probes it (ssh, then python on it); one that cannot be reached or cannot
run python is lost. With --elastic the restart leaves lost hosts out (DeepSpeed's --exclude) when the run's layout
still fits the ranks left (the CLI validates it); without it, a lost host ends the restarts, naming it. Other
preflight findings (a GPU count, a port) are not a host loss: the restart goes ahead and the launch reports them."""

from __future__ import annotations

from pathlib import Path

from deepseek_ds.launcher.preflight import PreflightOptions, failed, run_preflight
from deepseek_ds.launcher.remote import LOCAL_HOSTS

LOST = ("ssh", "python")  # preflight checks whose failure means the host cannot run its ranks at all


def lost_hosts(hostfile: str, include: str | None, exclude: str | None) -> dict[str, str]:
    """Host -> why it is lost (preflight's detail), of the hosts `hostfile` with these filters selects (each probe
    waits preflight's default timeout)."""
    options = PreflightOptions(hostfile=Path(hostfile), include=include or "", exclude=exclude or "", allow_cpu=True)
    _, checks = run_preflight(options)
    lost: dict[str, str] = {}
    for check in failed(checks):
        if check.name in LOST and check.host not in LOCAL_HOSTS:
            lost.setdefault(check.host, f"{check.name}: {check.detail}")
    return lost


def excluding(exclude: str | None, hosts: list[str]) -> str:
    """DeepSpeed's --exclude value that also leaves out `hosts` (whole hosts: host1@host2)."""
    return "@".join(([exclude] if exclude else []) + hosts)
