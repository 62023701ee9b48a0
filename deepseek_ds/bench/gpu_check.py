"""The one-command GPU check (`bash scripts/gpu_check.sh`): what only a GPU can show, measured side by side in one
process and written to docs/bench/gpu.md.

- precision: tiny-v3 trained in fp32, bf16 and fp16 (ZeRO-1) on the same batches; every step's loss within
  PRECISION_RTOL of fp32's.
- attention: the scaled_dot_product_attention backend that MLA's unequal q/k (192) and v (128) head sizes get, and
  which backends accept them at all, with their forward + backward time.
- speed: MFU, tokens/s and peak memory of a ~1B dense model and a 4-layer model of DeepSeek-V2-Lite's shapes (MLA,
  64 routed experts) at seq 2048, bf16, ZeRO-1, with each option on and off (the expert kernels; train.compile,
  last since inductor compiles for minutes), next to the ZeRO formula's model-state bytes.
- NCCL all-reduce bus bandwidth over every visible GPU (more than one).

Every model runs through the training code (bench.worker.measure: build_run + train_step) on one rank, one after
the other in this process, so no launch start-up is paid per variant. Each part is isolated: one that raises is
listed under Errors (its traceback in the log) and the others still run; gpu_check.json and the report are
rewritten after every part, and parts still waiting at --deadline-s are listed as not run, so a lent machine's time
limit never costs what was already measured. FusedAdam is built first; where it cannot be, the variants run torch's
AdamW (DeepSpeed's `torch_adam`), as the report notes. `--smoke` runs the same code path on the CPU with tiny models
and a step or two (CI's test); CUDA-only parts (fp16, NCCL) are listed as not run there, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import load_ds_config
from ..data import ensure_builtin_dataset
from ..utils.errors import UserError, run_command
from . import report
from .checkpoint_bench import single_process_env
from .gpu_probes import attention_backends, fused_adam, nccl_bus_bandwidth, sdpa_timing
from .gpu_report import Results, save, with_commit
from .launch import step_metrics
from .worker import device_name, free_memory, measure
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
# A lent GPU machine runs one command for at most 600 s: parts not started by then are skipped, leaving the one in
# flight and the wheel install before the check the rest.
DEADLINE_S = 480.0
SKIPPED = "skipped"  # Check.part's outcome for a part not started (an error reads "<exception type>: ...")

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

    @property
    def label(self) -> str:
        return f"{self.section}: {self.model}, {self.option}"


@dataclass
class Plan:
    variants: list[Variant]
    not_run: list[tuple[str, str]] = field(default_factory=list)  # (what, why)


def plan(smoke: bool, cuda: bool, data_dir: str, work_dir: str) -> Plan:
    """The variants to measure, in the order they run: full size on a GPU, tiny and a step or two on the CPU
    with --smoke. Precision first (the cheapest and the one that must not be missed), compilation last."""
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
    if smoke:  # the same families, tiny
        dense, moe, shape, micro = ("model.preset=tiny-dense",), ("model.preset=tiny-v2",), ("data.seq_len=64",), (2, 2)
        warmup, timed = 0, 1
        p.not_run.append(("train.compile=true", "inductor compiles for minutes on a CPU: eager only in --smoke"))
    else:
        dense, moe, shape, micro = DENSE_1B, V2_LITE_4_LAYERS, ("data.seq_len=2048",), (8, 4)
        warmup, timed = 3, 6  # compilation happens in the warm-up steps
    dense_name, moe_name = ("tiny-dense", "tiny-v2") if smoke else ("dense ~1B", "V2-Lite shapes, 4 layers")

    def dense_variant(option: str, compile_set: str) -> Variant:
        return Variant("speed", dense_name, option, bf16,
                       data + shape + dense + (f"train.micro_batch_size={micro[0]}", compile_set),
                       micro[0], warmup, timed)

    p.variants.append(dense_variant("compile off", "train.compile=false"))
    for kernel in ("grouped_mm", "eager"):
        p.variants.append(Variant("speed", moe_name, f"experts {kernel}", bf16,
                                  data + shape + moe + (f"train.micro_batch_size={micro[1]}",
                                                        f"model.experts_implementation={kernel}"),
                                  micro[1], warmup, timed))
    if not smoke:
        p.variants.append(dense_variant("compile on", "train.compile=true"))
    return p


def _write_config(ds: dict, work_dir: str, name: str) -> str:
    path = os.path.join(work_dir, name)
    with open(path, "w") as f:
        json.dump(ds, f, indent=2)
    return path


def fp16_config(work_dir: str) -> str:
    ds = load_ds_config(str(ROOT / "ds_configs/zero1_fp16.json"))
    ds["fp16"]["initial_scale_power"] = FP16_INITIAL_SCALE_POWER
    return _write_config(ds, work_dir, "zero1_fp16_scale8.json")


def torch_adam_config(path: str, work_dir: str) -> str:
    """The DeepSpeed config at `path` with torch's AdamW in place of DeepSpeed's FusedAdam."""
    ds = load_ds_config(path)
    ds["optimizer"]["params"]["torch_adam"] = True
    return _write_config(ds, work_dir, "torch_adam_" + os.path.basename(path))


def run_variant(v: Variant, work_dir: str) -> dict:
    """One variant through the training code on this process's single rank; its row."""
    out = os.path.join(work_dir, v.label.replace(": ", "-").replace(" ", "_").replace(",", ""))
    args = argparse.Namespace(config=str(ROOT / RECIPE), deepspeed_config=v.ds_config, warmup=v.warmup,
                              steps=v.steps, set=[*v.sets, f"train.output_dir={out}",
                                                  f"train.steps={v.warmup + v.steps + 1}"])
    start = time.perf_counter()
    r = measure(args, 1, v.global_batch)
    psi = sum(r["param_numels"])
    states = sum(zero_formula(psi, 1, r["zero_stage"], r["param_element_size"], True).values())
    return {"section": v.section, "model": v.model, "option": v.option, "precision": r["precision"],
            "params": psi, "losses": [s["loss"] for s in r["steps"]], "peak_memory": r["peak_memory"],
            "peak_reserved": r["peak_reserved"], "skipped_steps": r["skipped_steps"], "formula_bytes": states,
            "wall_s": time.perf_counter() - start, "step_seconds": [s["seconds"] for s in r["steps"]], **step_metrics([r])}


def precision_rows(rows: list[dict]) -> list[dict]:
    """Each measured precision row against fp32's losses; without an fp32 row there is nothing to compare with."""
    measured = [r for r in rows if "error" not in r]
    ref = next((r["losses"] for r in measured if r["option"] == "fp32"), None)
    for r in measured:
        r["first_loss"], r["last_loss"] = r["losses"][0], r["losses"][-1]
        if ref is not None:
            r["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
            r["within"] = r["max_rel_diff"] <= PRECISION_RTOL
    return rows


# ---------------------------------------------------------------------------------------------- driver
class Check:
    """Runs the check's parts one at a time, each isolated, and saves the results after each."""

    def __init__(self, results: Results, json_path: str, report_path: str, deadline_s: float, device: torch.device):
        self.results, self.json_path, self.report_path = results, json_path, report_path
        self.deadline_s, self.device = deadline_s, device

    def save(self) -> None:
        env = report.environment([{"device": device_name(self.device), "threads": torch.get_num_threads()}])
        save(self.results, self.json_path, self.report_path, with_commit(env))

    def part(self, what: str, fn: Callable[[], None]) -> str | None:
        """Run `fn` unless past the deadline. None when it ran through; else why not (also listed in the report)."""
        r = self.results
        if r.wall_s > self.deadline_s:
            r.not_run.append((what, f"skipped: past --deadline-s ({self.deadline_s:.0f} s)"))
            self.save()
            return SKIPPED
        r.running = what
        self.save()
        print(f"gpu check: {what} ...", flush=True)
        error = None
        try:
            fn()
        except Exception as e:  # one part's failure must not cost the others theirs
            traceback.print_exc()
            lines = str(e).strip().splitlines()  # the first line says what (CUDA OOM's last only where to read)
            error = f"{type(e).__name__}: {lines[0][:300] if lines else ''}"
        # Here, past the except block, the traceback and the frames holding the failed variant's tensors are gone.
        free_memory()
        r.running = None
        if error:
            r.errors.append((what, error))
        self.save()
        return error

    def variant(self, v: Variant, work_dir: str) -> None:
        row: dict = {}
        error = self.part(v.label, lambda: row.update(run_variant(v, work_dir)))
        if error != SKIPPED:
            self.results.rows.append(row if error is None else
                                     {"section": v.section, "model": v.model, "option": v.option, "error": error})
        self.save()

    def optimizer(self, p: Plan, work_dir: str) -> None:
        """FusedAdam built before the first variant needs it, or torch's AdamW for every variant."""
        status: list[tuple[bool, str]] = []
        outcome = self.part("FusedAdam build", lambda: status.append(fused_adam()))
        ok, note = status[0] if status else (False, f"FusedAdam: not checked ({outcome})")
        if not ok:
            note += "; every variant runs torch's AdamW instead (optimizer.params.torch_adam)"
            configs = {path: torch_adam_config(path, work_dir) for path in {v.ds_config for v in p.variants}}
            p.variants[:] = [dataclasses.replace(v, ds_config=configs[v.ds_config]) for v in p.variants]
        self.results.notes.append(note)


def attention_part(results: Results, device: torch.device, smoke: bool) -> None:
    shape = {"qk_dim": 192, "v_dim": 128, "heads": 16, "seq": 128 if smoke else 2048, "dtype": "bf16",
             "timing": sdpa_timing(device)}
    results.sdpa_chosen, results.sdpa_backends = attention_backends(
        device, torch.bfloat16, shape["seq"], shape["heads"], qk_dim=shape["qk_dim"], v_dim=shape["v_dim"])
    results.attention_shape = shape


def run_gpu_check(smoke: bool, data_dir: str | None, work_dir: str, report_path: str,
                  deadline_s: float = DEADLINE_S) -> Results:
    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        raise GpuCheckError("no CUDA device is visible (torch.cuda.is_available() is False)",
                            hint="run it on a GPU machine, or pass --smoke for the CPU smoke run")
    results = Results(smoke, PRECISION_RTOL, FP16_INITIAL_SCALE_POWER)
    os.makedirs(work_dir, exist_ok=True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    check = Check(results, os.path.join(work_dir, "gpu_check.json"), report_path, deadline_s, device)
    data_dir = data_dir or ensure_builtin_dataset(str(ROOT / "data_cache"), 2048, 8.0, progress=False)
    p = plan(smoke, cuda, data_dir, work_dir)
    results.not_run.extend(p.not_run)
    check.optimizer(p, work_dir)
    gpus = torch.cuda.device_count() if cuda else 0
    # Before this process joins a process group of its own: the launch starts one rank per GPU.
    if gpus > 1:
        check.part("NCCL all-reduce", lambda: setattr(results, "nccl", nccl_bus_bandwidth(gpus, ROOT)))
    else:
        results.nccl = "not run: " + ("one GPU visible" if cuda else "no GPU (NCCL needs CUDA)")
    single_process_env()
    try:
        for v in [v for v in p.variants if v.section == "precision"]:
            check.variant(v, work_dir)
        precision_rows(results.measured("precision"))
        check.part("attention (sdpa backends)", lambda: attention_part(results, device, smoke))
        for v in [v for v in p.variants if v.section != "precision"]:
            check.variant(v, work_dir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    check.save()
    return results


def exit_status(results: Results) -> int:
    failed = [r["option"] for r in results.measured("precision") if r.get("within") is False]
    if failed:
        print(f"gpu check: {', '.join(failed)} losses differ from fp32 by more than {PRECISION_RTOL:.0%}",
              file=sys.stderr)
        return 3
    if results.errors:
        print(f"gpu check: {len(results.errors)} part(s) failed: " + "; ".join(w for w, _ in results.errors),
              file=sys.stderr)
        return 4
    return 0


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
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S,
                        help="parts not started this many seconds after the start are skipped and listed as not "
                             f"run (default: {DEADLINE_S:.0f}, for a 600 s limit)")
    args = parser.parse_args(argv)
    path = args.report or (os.path.join(args.work_dir, "gpu.md") if args.smoke else str(ROOT / "docs/bench/gpu.md"))

    def check() -> int:
        results = run_gpu_check(args.smoke, args.data, args.work_dir, path, args.deadline_s)
        print(f"wrote {path} and {os.path.join(args.work_dir, 'gpu_check.json')}")
        return exit_status(results)

    return run_command(check)


if __name__ == "__main__":
    sys.exit(main())
