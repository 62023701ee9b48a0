"""The one-command GPU check (`bash scripts/gpu_check.sh`): what only a GPU can show, measured side by side in one
process and written to docs/bench/gpu.md.

- precision: tiny-v3 trained in fp32, bf16 and fp16 (ZeRO-1) on the same batches; every step's loss within
  PRECISION_RTOL of fp32's.
- speed: MFU, tokens/s and peak memory of a ~1B dense model and a 4-layer model of DeepSeek-V2-Lite's shapes (MLA,
  64 routed experts) at seq 2048, bf16, ZeRO-1, with each option on and off (train.compile; the expert kernels),
  next to the ZeRO formula's model-state bytes.
- attention: the scaled_dot_product_attention backend that MLA's unequal q/k (192) and v (128) head sizes get, and
  which backends accept them at all, with their forward + backward time.
- NCCL all-reduce bus bandwidth over every visible GPU (more than one).

Every model runs through the training code (bench.worker.measure: build_run + train_step) on one rank, one after
the other in this process, so no launch start-up is paid per variant (about 8 minutes on one H200). `--smoke` runs
the same code path on the CPU with tiny models and a step or two (CI's test); CUDA-only parts (fp16, NCCL) are
listed as not run there, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import load_ds_config
from ..data import ensure_builtin_dataset
from ..launcher import bandwidth
from ..utils.errors import UserError, run_command
from ..utils.net import free_port
from . import report
from .checkpoint_bench import single_process_env
from .launch import step_metrics
from .worker import free_memory, measure
from .zero_bench import zero_formula

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny-v3.yaml"
# bf16 keeps 8 bits of mantissa (~0.4% per rounding), fp16 10; over a few dozen steps of a 2M-parameter model the
# losses stay well within 2% of fp32's, while a broken mixed-precision path (no master weights, a wrong loss scale)
# misses by far more.
PRECISION_RTOL = 0.02
# fp16's default initial loss scale (2^16) overflows in the first ~16 steps, which DeepSpeed then skips: fp16 would
# be compared step for step with an fp32 run that took more updates. 2^8 does not overflow on tiny-v3.
FP16_INITIAL_SCALE_POWER = 8

DENSE_1B = ("model.preset=tiny-dense", "model.overrides.vocab_size=32256", "model.overrides.hidden_size=2048",
            "model.overrides.intermediate_size=5632", "model.overrides.num_hidden_layers=16",
            "model.overrides.num_attention_heads=16", "model.overrides.num_key_value_heads=16",
            "model.overrides.max_position_embeddings=4096")
V2_LITE_4_LAYERS = ("model.preset=deepseek-v2-lite", "model.overrides.num_hidden_layers=4")


class GpuCheckError(UserError):
    """The check cannot run as asked (no GPU without --smoke)."""


@dataclass(frozen=True)
class Variant:
    section: str          # "precision" or "speed"
    model: str
    option: str
    ds_config: str        # absolute path
    sets: tuple[str, ...]
    global_batch: int     # on one rank: micro-batch x gradient accumulation
    warmup: int
    steps: int


@dataclass
class Plan:
    variants: list[Variant]
    not_run: list[tuple[str, str]] = field(default_factory=list)  # (what, why)


def plan(smoke: bool, cuda: bool, data_dir: str, work_dir: str) -> Plan:
    """The variants to measure: full size on a GPU, tiny and a step or two on the CPU with --smoke."""
    data = (f"data.path={data_dir}", "eval.interval=0", "checkpoint.interval=0")
    p = Plan([])
    precisions = [("fp32", str(ROOT / "ds_configs/zero1.json")), ("bf16", str(ROOT / "ds_configs/zero1_bf16.json"))]
    if cuda:
        precisions.append(("fp16", fp16_config(work_dir)))
    else:
        p.not_run.append(("fp16 precision run", "fp16 needs CUDA (DeepSpeed's CPU accelerator has no fp16)"))
    # The recipe's batch (micro 8, global 16: 2 micro-batches); one micro-batch in --smoke.
    for name, ds in precisions:
        p.variants.append(Variant("precision", "tiny-v3", name, ds, data, 8 if smoke else 16, 0, 1 if smoke else 30))

    bf16 = str(ROOT / "ds_configs/zero1_bf16.json")
    compile_options = [("compile off", "train.compile=false"), ("compile on", "train.compile=true")]
    if smoke:  # the same families, tiny
        dense, moe, shape, micro = ("model.preset=tiny-dense",), ("model.preset=tiny-v2",), ("data.seq_len=64",), (2, 2)
        warmup, timed = 0, 1
        p.not_run.append(("train.compile=true", "inductor compiles for minutes on a CPU: eager only in --smoke"))
        compile_options = compile_options[:1]
    else:
        dense, moe, shape, micro = DENSE_1B, V2_LITE_4_LAYERS, ("data.seq_len=2048",), (8, 4)
        warmup, timed = 3, 6  # compilation happens in the warm-up steps
    dense_name, moe_name = ("tiny-dense", "tiny-v2") if smoke else ("dense ~1B", "V2-Lite shapes, 4 layers")
    for option, s in compile_options:
        p.variants.append(Variant("speed", dense_name, option, bf16,
                                  data + shape + dense + (f"train.micro_batch_size={micro[0]}", s),
                                  micro[0], warmup, timed))
    for kernel in ("grouped_mm", "eager"):
        p.variants.append(Variant("speed", moe_name, f"experts {kernel}", bf16,
                                  data + shape + moe + (f"train.micro_batch_size={micro[1]}",
                                                        f"model.experts_implementation={kernel}"),
                                  micro[1], warmup, timed))
    return p


def fp16_config(work_dir: str) -> str:
    ds = load_ds_config(str(ROOT / "ds_configs/zero1_fp16.json"))
    ds["fp16"]["initial_scale_power"] = FP16_INITIAL_SCALE_POWER
    path = os.path.join(work_dir, "zero1_fp16_scale8.json")
    with open(path, "w") as f:
        json.dump(ds, f, indent=2)
    return path


def run_variant(v: Variant, work_dir: str) -> dict:
    """One variant through the training code on this process's single rank; its row."""
    out = os.path.join(work_dir, f"{v.section}-{v.model}-{v.option}".replace(" ", "_").replace(",", ""))
    args = argparse.Namespace(config=str(ROOT / RECIPE), deepspeed_config=v.ds_config, warmup=v.warmup,
                              steps=v.steps, set=[*v.sets, f"train.output_dir={out}",
                                                  f"train.steps={v.warmup + v.steps + 1}"])
    print(f"gpu check: {v.section}: {v.model}, {v.option} ...", flush=True)
    start = time.perf_counter()
    r = measure(args, 1, v.global_batch)
    free_memory()  # before the next variant's model is built
    psi = sum(r["param_numels"])
    states = sum(zero_formula(psi, 1, r["zero_stage"], r["param_element_size"], True).values())
    return {"section": v.section, "model": v.model, "option": v.option, "precision": r["precision"],
            "params": psi, "losses": [s["loss"] for s in r["steps"]], "peak_memory": r["peak_memory"],
            "formula_bytes": states, "wall_s": time.perf_counter() - start, "rank": r, **step_metrics([r])}


def precision_rows(rows: list[dict]) -> list[dict]:
    ref = next(r for r in rows if r["option"] == "fp32")["losses"]
    for r in rows:
        r["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        r["first_loss"], r["last_loss"] = r["losses"][0], r["losses"][-1]
        r["within"] = r["max_rel_diff"] <= PRECISION_RTOL
    return rows


# ---------------------------------------------------------------------------------------------- attention
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)


def attention_backends(device: torch.device, dtype: torch.dtype, seq: int, heads: int = 16, batch: int = 1,
                       qk_dim: int = 192, v_dim: int = 128) -> tuple[dict[str, str], list[dict]]:
    """Which backend sdpa dispatches MLA's shapes to (causal without a mask, as transformers calls it, and with
    a boolean mask, as document masks do), and per backend whether it runs them and its forward + backward ms."""
    q, k, v = (torch.randn(batch, heads, seq, d, device=device, dtype=dtype, requires_grad=True)
               for d in (qk_dim, qk_dim, v_dim))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    calls = {"causal, no mask": {"is_causal": True}, "boolean mask": {"attn_mask": mask}}
    chosen = {label: SDPBackend(torch._fused_sdp_choice(q, k, v, kw.get("attn_mask"), 0.0,
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


def _time_sdpa(backend: SDPBackend, q, k, v, kw: dict, reps: int = 3) -> float:
    with sdpa_kernel(backend):
        for i in range(reps + 1):
            if i == 1:  # the first call is untimed (kernel selection, workspace allocation)
                _synchronize(q.device)
                start = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
        _synchronize(q.device)
    return (time.perf_counter() - start) / reps


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nccl_bus_bandwidth(gpus: int) -> str:
    """allreduce_bench.py (preflight --bandwidth's) on every visible GPU of this host, 256 MiB x 20."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--master_port",
           str(free_port()), str(bandwidth.BENCH_SCRIPT), "--size-mb", "256", "--iters", "20"]
    result = bandwidth.measure(cmd, ROOT)
    return result.detail if result.ok else f"failed: {result.detail}"


# ---------------------------------------------------------------------------------------------- report
PRECISION_COLUMNS = [report.Column("option", "precision"), report.Column("first_loss", "first loss", "{:.4f}"),
                     report.Column("last_loss", "last loss", "{:.4f}"),
                     report.Column("max_rel_diff", "max relative diff vs fp32", "{:.2e}"),
                     report.Column("within", f"within {PRECISION_RTOL:.0%}")]
SPEED_COLUMNS = [report.Column("model", "model"), report.Column("option", "option"),
                 report.Column("params", "params", "{:,}"), report.Column("seq_len", "seq"),
                 report.Column("micro_batch_size", "micro-batch"),
                 report.Column("tokens_per_s", "tokens/s", "{:,.0f}"),
                 report.Column("tflops_per_device", "TFLOP/s", "{:.1f}"), report.Column("mfu", "MFU", "{:.1%}"),
                 report.Column("peak_memory", "peak memory", "bytes"),
                 report.Column("formula_bytes", "model states (ZeRO formula)", "bytes"),
                 report.Column("wall_s", "wall s (build + steps)", "{:.0f}")]


def write_report(path: str, result: dict) -> None:
    rows = result["rows"]
    precision = [r for r in rows if r["section"] == "precision"]
    speed = [r for r in rows if r["section"] == "speed"]
    smoke = " (--smoke: tiny models on the CPU; not GPU figures)" if result["smoke"] else ""
    attention = "\n".join(f"- {call}: **{name}**" for call, name in result["sdpa_chosen"].items())
    a = result["attention_shape"]
    blocks = [
        f"# GPU check{smoke}",
        f"Written by `bash scripts/gpu_check.sh{' --smoke' if result['smoke'] else ''}` "
        f"(deepseek_ds/bench/gpu_check.py) in {result['wall_s']:.0f} s.",
        f"## Precision: tiny-v3, ZeRO-1, one rank, {len(precision[0]['losses'])} steps on the same batches\n\n"
        f"Every step's loss within {PRECISION_RTOL:.0%} (relative) of fp32's; fp16 starts at loss scale "
        f"2^{FP16_INITIAL_SCALE_POWER} so no early step is skipped.\n\n"
        + report.markdown_table(precision, PRECISION_COLUMNS),
        "## Speed and memory: bf16, ZeRO-1, one rank, each option on and off\n\n"
        "MFU against the device's bf16 dense peak (training/metrics.PEAK_TFLOPS_BF16), FLOPs from models/flops.py "
        "(median step of the timed ones). Peak memory: CUDA's max allocated (CPU: the process's peak RSS so far); "
        "the ZeRO formula counts parameters, gradients and optimizer state only (activations, logits and "
        "workspace are the rest). This tree has no `plan` command yet, so the formula is the estimate.\n\n"
        + report.markdown_table(speed, SPEED_COLUMNS),
        f"## Attention: sdpa with MLA's head sizes (q/k {a['qk_dim']}, v {a['v_dim']}; {a['heads']} heads, "
        f"seq {a['seq']}, {a['dtype']})\n\nThe backend scaled_dot_product_attention dispatches to:\n\n{attention}\n\n"
        "Each backend forced (`torch.nn.attention.sdpa_kernel`), forward + backward:\n\n"
        + report.markdown_table(result["sdpa_backends"], [report.Column(k, k) for k in result["sdpa_backends"][0]]),
        f"## NCCL all-reduce\n\n{result['nccl']}",
        "## Not run\n\n" + ("\n".join(f"- {what}: {why}" for what, why in result["not_run"]) or "nothing"),
        "## Environment\n\n" + report.environment_markdown(report.environment([rows[-1]["rank"]])),
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    report.write_markdown(path, blocks)


# ---------------------------------------------------------------------------------------------- driver
def run_gpu_check(smoke: bool, data_dir: str | None, work_dir: str) -> dict:
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        raise GpuCheckError("no CUDA device is visible (torch.cuda.is_available() is False)",
                            hint="run it on a GPU machine, or pass --smoke for the CPU smoke run")
    os.makedirs(work_dir, exist_ok=True)
    data_dir = data_dir or ensure_builtin_dataset(str(ROOT / "data_cache"), 2048, 8.0, progress=False)
    p = plan(smoke, cuda, data_dir, work_dir)
    gpus = torch.cuda.device_count() if cuda else 0
    # Before this process joins a process group of its own: the launch starts one rank per GPU.
    if gpus > 1:
        nccl = nccl_bus_bandwidth(gpus)
    else:
        nccl = "not run: " + ("one GPU visible" if cuda else "no GPU (NCCL needs CUDA)")
    single_process_env()
    try:
        rows = [run_variant(v, work_dir) for v in p.variants]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    precision_rows([r for r in rows if r["section"] == "precision"])
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = {"qk_dim": 192, "v_dim": 128, "heads": 16, "seq": 128 if smoke else 2048, "dtype": "bf16"}
    chosen, backends = attention_backends(device, torch.bfloat16, shape["seq"], shape["heads"],
                                          qk_dim=shape["qk_dim"], v_dim=shape["v_dim"])
    return {"smoke": smoke, "rows": rows, "sdpa_chosen": chosen, "sdpa_backends": backends, "attention_shape": shape,
            "nccl": nccl, "not_run": p.not_run, "wall_s": time.perf_counter() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: the code path, not figures")
    parser.add_argument("--report", default=None,
                        help="markdown report (default: docs/bench/gpu.md; with --smoke: WORK_DIR/gpu.md)")
    parser.add_argument("--work-dir", default=str(ROOT / "runs" / "gpu_check"),
                        help="run outputs and gpu_check.json, the raw rows (default: runs/gpu_check)")
    parser.add_argument("--data", default=None,
                        help="a prepared dataset with at most 2048 tokens (default: the built-in corpus, 8 MB)")
    args = parser.parse_args(argv)

    def check() -> int:
        result = run_gpu_check(args.smoke, args.data, args.work_dir)
        path = args.report or (os.path.join(args.work_dir, "gpu.md") if args.smoke else str(ROOT / "docs/bench/gpu.md"))
        write_report(path, result)
        with open(os.path.join(args.work_dir, "gpu_check.json"), "w") as f:
            json.dump({k: v for k, v in result.items() if k != "rows"}
                      | {"rows": [{k: v for k, v in r.items() if k != "rank"} for r in result["rows"]]}, f, indent=2)
        print(f"wrote {path}")
        failed = [r["option"] for r in result["rows"] if r["section"] == "precision" and not r["within"]]
        if failed:
            print(f"gpu check: {', '.join(failed)} losses differ from fp32 by more than {PRECISION_RTOL:.0%}",
                  file=sys.stderr)
            return 3
        return 0

    return run_command(check)


if __name__ == "__main__":
    sys.exit(main())
