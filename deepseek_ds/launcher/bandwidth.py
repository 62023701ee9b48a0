"""`preflight --bandwidth`: launch allreduce_bench.py with the deepspeed launcher across the job's
hosts and read back the bus bandwidth. Going through `deepspeed --hostfile` (pdsh, .deepspeed_env,
master address) tests the real launch path, not just the links."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from deepseek_ds.launcher.per_host import runner_command
from deepseek_ds.launcher.preflight import PreflightOptions

# A warm 4-rank CPU launch takes ~20 s; the script's own collective timeout (60 s) ends a stuck
# rank well before this.
LAUNCH_TIMEOUT_S = 240
OUTPUT_TAIL_LINES = 15
BENCH_SCRIPT = Path(__file__).with_name("allreduce_bench.py")
# allreduce_bench.RESULT_MARKER, spelled out because importing that module imports torch (~1 s),
# which preflight itself never needs.
RESULT_MARKER = "DSBW "


@dataclass(frozen=True)
class BandwidthResult:
    ok: bool
    detail: str  # "bus 1.23 GB/s ..." or why it failed (with the launch's last output lines)


def bandwidth_command(options: PreflightOptions, hosts: list[str]) -> list[str]:
    return runner_command(options, hosts) + [str(BENCH_SCRIPT)]


def measure(command: list[str], cwd: Path) -> BandwidthResult:
    # Own session: on timeout the launcher, pdsh and its ssh clients are killed together.
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return BandwidthResult(False, f"launch did not finish within {LAUNCH_TIMEOUT_S} s:\n{_tail(output)}")
    for line in output.splitlines():
        _, marker, payload = line.partition(RESULT_MARKER)
        if marker:
            r = json.loads(payload)
            return BandwidthResult(True, f"bus {r['busbw_gbps']:.3f} GB/s (algorithm {r['algbw_gbps']:.3f} GB/s; "
                                         f"{r['size_bytes'] / 2**20:g} MiB all-reduce x {r['iters']}, "
                                         f"{r['world_size']} ranks, {r['backend']})")
    return BandwidthResult(False, f"launch exited {proc.returncode} without a result:\n{_tail(output)}")


def _tail(output: str) -> str:
    return "\n".join(output.strip().splitlines()[-OUTPUT_TAIL_LINES:])
