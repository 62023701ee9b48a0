"""The GPU check's measurements outside the training code: which sdpa backend MLA's head sizes get (and each
backend's forward + backward time), NCCL's all-reduce bus bandwidth, and whether DeepSpeed's FusedAdam builds."""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..launcher import bandwidth
from ..utils.net import free_port
from ..utils.private_api import sdpa_backend_choice

BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)
# Timed forward + backward calls per backend after an untimed first one: a GPU call takes milliseconds, so ten
# average out launch jitter; on the CPU (--smoke) each is slow and only the code path matters.
SDPA_REPS = {"cuda": 10, "cpu": 3}


def attention_backends(device: torch.device, dtype: torch.dtype, seq: int, heads: int = 16, batch: int = 1,
                       qk_dim: int = 192, v_dim: int = 128) -> tuple[dict[str, str], list[dict]]:
    """Which backend sdpa dispatches MLA's shapes to (causal without a mask, as transformers calls it, and with
    a boolean mask, as document masks do), and per backend whether it runs them and its forward + backward ms."""
    q, k, v = (torch.randn(batch, heads, seq, d, device=device, dtype=dtype, requires_grad=True)
               for d in (qk_dim, qk_dim, v_dim))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    calls = {"causal, no mask": {"is_causal": True}, "boolean mask": {"attn_mask": mask}}
    chosen = {label: SDPBackend(sdpa_backend_choice(q, k, v, kw.get("attn_mask"), 0.0,
                                                    kw.get("is_causal", False))).name
              for label, kw in calls.items()}
    rows = []
    for backend in BACKENDS:
        row = {"backend": backend.name}
        for label, kw in calls.items():
            try:
                row[label] = f"{_time_sdpa(backend, q, k, v, kw) * 1e3:.2f} ms"
            except RuntimeError as e:  # the backend refuses these shapes, dtype or device
                row[label] = "refused: " + str(e).strip().splitlines()[0][:60]
        rows.append(row)
    return chosen, rows


def sdpa_timing(device: torch.device) -> str:
    """How _time_sdpa times a call on `device`, for the report."""
    how = "CUDA events" if device.type == "cuda" else "perf_counter"
    return f"{how}, mean of {SDPA_REPS[device.type]} calls after an untimed one"


def _time_sdpa(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict) -> float:
    """Seconds per forward + backward. The first call is untimed (kernel selection, workspace allocation); on
    CUDA, events time the kernels themselves rather than the host's launches."""
    reps = SDPA_REPS[q.device.type]

    def call() -> None:
        F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()

    with sdpa_kernel(backend):
        call()
        if q.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        start_s = time.perf_counter()
        for _ in range(reps):
            call()
        return (time.perf_counter() - start_s) / reps


def nccl_bus_bandwidth(gpus: int, root: Path) -> str:
    """allreduce_bench.py (preflight --bandwidth's) on every visible GPU of this host, 256 MiB x 20."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--master_port",
           str(free_port()), str(bandwidth.BENCH_SCRIPT), "--size-mb", "256", "--iters", "20"]
    result = bandwidth.measure(cmd, root)
    return result.detail if result.ok else f"failed: {result.detail}"


def fused_adam() -> tuple[bool, str]:
    """Build (or load from TORCH_EXTENSIONS_DIR) DeepSpeed's FusedAdam, the op its AdamW uses unless
    `torch_adam` is set, before any variant needs it: on a fresh GPU machine that is a 45-90 s nvcc JIT build
    which may fail (no nvcc, a CUDA/compiler mismatch). Whether it is usable, and what happened."""
    start = time.perf_counter()
    builder = get_accelerator().create_op_builder("FusedAdamBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        return False, "FusedAdam: not available for this accelerator"
    try:
        builder.load(verbose=False)
    except Exception as e:  # any build failure: the variants then run torch's AdamW instead
        traceback.print_exc()
        return False, f"FusedAdam failed to build ({type(e).__name__}: {str(e).strip()[:200]})"
    return True, f"FusedAdam built or loaded in {time.perf_counter() - start:.0f} s"
