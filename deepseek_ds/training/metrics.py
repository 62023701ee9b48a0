"""Per-step metrics: the JSON-lines file, throughput, FLOPs, MFU and memory, and the loss-curve plot."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ..models import flops
from ..models.pipeline import layer_costs
from ..utils.errors import UserError
from ..utils.fs import write_bytes_atomic

# Dense bf16 tensor-core peak of one device in TFLOP/s (vendor data sheets), matched in order against
# torch.cuda.get_device_name(): more specific names first ("GH200" before "H200", "A100" before "A10").
PEAK_TFLOPS_BF16 = (
    ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0),
    ("GH200", 989.4), ("H200", 989.4), ("H100 NVL", 835.5), ("H100 PCIE", 756.4), ("H100", 989.4),
    ("H800 PCIE", 756.4), ("H800", 989.4), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10", 125.0),
    ("RTX 4090", 165.2),  # Ada Lovelace whitepaper: bf16 with FP32 accumulate, as training accumulates
    ("MI325X", 1307.4), ("MI300X", 1307.4), ("MI250X", 383.0),
)


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """The per-device peak MFU is measured against: the configured one, else the table's for a known GPU,
    else None (CPUs and unknown GPUs report no MFU rather than a made-up one)."""
    if configured:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    return next((peak for key, peak in PEAK_TFLOPS_BF16 if key in name), None)


# Linux: the process's peak resident set ("high water mark") and the file whose "5" resets it to the current RSS
# (Linux 4.0+; proc(5) /proc/pid/clear_refs).
PROC_STATUS, PROC_CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak: CUDA's allocator statistics on a GPU; on CPU the process's VmHWM. False where the OS has no
    such reset (not Linux, or /proc not writable): the peak then stays the process's lifetime peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open(PROC_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory since the last reset_peak_memory: CUDA's peak allocated bytes on a GPU; on CPU the
    process's peak resident set (VmHWM; without /proc, getrusage's ru_maxrss, the lifetime peak)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open(PROC_STATUS) as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except (OSError, StopIteration):
        # ru_maxrss is KiB on Linux, bytes on macOS.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def memory_gb(device: torch.device) -> float:
    """memory_gb: this rank's peak since the last reset (peak_memory_bytes) in GiB (2^30 bytes; the field's name
    is older than the unit's spelling)."""
    return peak_memory_bytes(device) / 2**30


def flops_per_token(model_config, seq_len: int) -> float:
    """Training FLOPs per token of the whole model, MTP modules included (the formula: models/flops.py)."""
    return float(flops.per_token(layer_costs(model_config), model_config, seq_len))


class StepMeter:
    """Times one optimizer step (start/stop around it on every rank) and turns it into throughput, TFLOPs per
    device and MFU; memory() is this rank's peak memory during the step (reset by start()), which the loop reduces
    (largest over ranks) with the step's other metrics. `resets`: False where the OS cannot reset a CPU process's
    peak, so memory() is the process's lifetime peak."""

    def __init__(self, flops_per_step: float, tokens_per_step: int, samples_per_step: int, world: int,
                 device: torch.device, peak: float | None):
        self.flops, self.tokens, self.samples = flops_per_step, tokens_per_step, samples_per_step
        self.world, self.device, self.peak = world, device, peak
        self._t0 = 0.0
        self.resets = reset_peak_memory(device)

    def start(self) -> None:
        if self.resets:
            reset_peak_memory(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> dict:
        dt = time.perf_counter() - self._t0
        tflops = self.flops / dt / self.world / 1e12
        return {"tokens_per_sec": self.tokens / dt, "samples_per_sec": self.samples / dt,
                "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None, "step_time": dt}

    def memory(self) -> torch.Tensor:
        """memory_gb of this rank as a one-element device tensor (for the step's MAX all-reduce): made on the device,
        so no host-to-device copy (a blocking one syncs a GPU)."""
        return torch.full((1,), memory_gb(self.device), dtype=torch.float64, device=self.device)


class PhaseTimes:
    """Seconds this rank spends in each named phase of its steps (GRPO: generation, reference, update), summed until
    taken. On a GPU each phase ends with a synchronize, so its work is counted in it and not in the next."""

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.names, self.device = names, device
        self._seconds = dict.fromkeys(names, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._seconds[name] += time.perf_counter() - started

    def take(self) -> torch.Tensor:
        """[seconds of each phase] (float64, on the device) since the last take, then zero."""
        out = torch.tensor([self._seconds[n] for n in self.names], dtype=torch.float64, device=self.device)
        self._seconds = dict.fromkeys(self.names, 0.0)
        return out


def console_line(record: dict) -> str:
    """The progress bar's summary of one step record."""
    def num(key: str, fmt: str) -> str:
        value = record.get(key)
        return "-" if value is None else format(value, fmt)

    parts = [f"loss {num('loss', '.4f')}", f"lr {num('lr', '.2e')}", f"gnorm {num('grad_norm', '.3f')}",
             f"{num('tokens_per_sec', '.0f')} tok/s", f"{num('tflops_per_device', '.3g')} TFLOP/s",
             f"mfu {num('mfu', '.1%')}", f"peak mem {num('memory_gb', '.2f')} GiB"]
    if "mtp_loss" in record:
        parts.insert(1, f"lm {num('lm_loss', '.4f')}, mtp {num('mtp_loss', '.4f')}")
    if "moe/load_ratio_max" in record:
        parts.append(f"expert max/mean {num('moe/load_ratio_max', '.2f')}")
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    if record.get("eval_loss") is not None:
        parts.append(f"val {num('eval_loss', '.4f')}")
    if record.get("task_exact_match") is not None:
        parts.append(f"task EM {num('task_exact_match', '.1%')}, BLEU {num('task_bleu', '.2f')}")
    return ", ".join(parts)


class MetricsWriter:
    """Appends one JSON object per optimizer step; keeps the values for the final summary and plot. A run resumed
    at `resume_step` keeps the records up to it (events too: `deepseek-ds train --max-restarts`' restarts); those of
    steps after the checkpoint (trained again now) are dropped, so every step appears once."""

    def __init__(self, path: str, resume_step: int = 0):
        self.path = path
        kept = []
        if resume_step and os.path.exists(path):
            kept = [r for r in read_metrics(path, events=True) if r["step"] <= resume_step]
        write_bytes_atomic(Path(path), "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.records: list[dict] = [r for r in kept if "event" not in r]
        self._file = open(path, "a")

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        self.records.append(record)

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str, events: bool = False) -> list[dict]:
    """The step records of a metrics.jsonl (events: also the records of events, {"event": ..., "step": ...}). A last
    line that does not parse was torn by a kill while it was written: it is dropped, and loses nothing, because a
    step's record is written before that step's checkpoint, so its step is after the one resumed from. A torn line
    anywhere else is damage, and an error."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i < len(lines) - 1:
                raise UserError(f"{path} line {i + 1} is not JSON ({e.msg})", "repair or delete that line (the "
                                "checkpoints do not depend on it) and resume again") from None
    return [r for r in records if events or "event" not in r]


def source_metrics(labels: list[str], sums: list[float]) -> dict:
    """A blend's per-source training metrics from [(summed main CE, valid targets)] per source, summed over the
    ranks: loss/<source> (token-weighted, as `loss` is: their token-weighted mean is the main loss) and
    tokens/<source>."""
    out = {}
    for i, label in enumerate(labels):
        ce, tokens = sums[2 * i], sums[2 * i + 1]
        out[f"loss/{label}"], out[f"tokens/{label}"] = (ce / tokens if tokens else None), int(tokens)
    return out


def plot_loss(records: list[dict], path: str, title: str) -> None:
    # Imported here: ~1 s that only the final plot needs, and the backend must be chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def values(key: str) -> list[float]:
        # A non-finite loss is null in metrics.jsonl: plot it as a gap.
        return [math.nan if r.get(key) is None else r[key] for r in records]

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    # Markers keep a step between two gaps (skipped non-finite losses) visible.
    ax.plot([r["step"] for r in records], values("loss"), ".-", lw=1.2, ms=3, label="train loss")
    for key in sorted({k for r in records for k in r if k.startswith("loss/")}):  # a blend's sources
        ax.plot([r["step"] for r in records], values(key), "-", lw=0.8, alpha=0.7, label=f"train {key}")
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", lw=1.2, label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()
    tasks = [r for r in records if r.get("task_exact_match") is not None]
    if tasks:  # eval.task: exact match and BLEU on a second axis, as fractions
        scores = ax.twinx()
        steps = [r["step"] for r in tasks]
        scores.plot(steps, [r["task_exact_match"] for r in tasks], "s--", color="tab:green", label="task exact match")
        scores.plot(steps, [r["task_bleu"] / 100 for r in tasks], "^--", color="tab:red", label="task BLEU / 100")
        scores.set_ylim(0, 1)
        scores.set_ylabel("task score")
        handles = [a + b for a, b in zip(handles, scores.get_legend_handles_labels())]
    ax.legend(*handles)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class NamedReduction:
    """Named float64 device tensors reduced over all ranks in ONE all-reduce (the step's metrics: a SUM pack and a
    MAX pack), each read back by its name rather than by its offset in the packed tensor. An absent (None) entry
    takes no room."""

    def __init__(self, device: torch.device):
        self.device = device
        self.parts: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            self.parts[name] = tensor.reshape(-1)

    def reduce(self, op) -> dict[str, torch.Tensor]:
        """name -> its reduced values (views of the one reduced tensor, still on the device)."""
        if not self.parts:
            return {}
        flat = torch.cat(list(self.parts.values()))
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flat, op=op)
        return dict(zip(self.parts, flat.split([t.numel() for t in self.parts.values()])))


def read_to_host(named: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """name -> values on the host, in ONE device-to-host read for all of them (the step's only sync of ours)."""
    if not named:
        return {}
    flat = torch.cat([t.reshape(-1) for t in named.values()]).tolist()
    out, at = {}, 0
    for name, t in named.items():
        out[name], at = flat[at:at + t.numel()], at + t.numel()
    return out
