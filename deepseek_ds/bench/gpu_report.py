"""The GPU check's results as they accumulate, and their report: gpu_check.json (the raw rows) and the markdown
page, both rewritten after every part so an error, the deadline or a kill keeps what was measured until then."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..utils.fs import write_json_atomic
from . import report

COMMIT_ENV = "DEEPSEEK_DS_COMMIT"  # the commit when the tree was copied without .git (a lent GPU machine)

PRECISION_COLUMNS = [report.Column("option", "precision"), report.Column("first_loss", "first loss", "{:.4f}"),
                     report.Column("last_loss", "last loss", "{:.4f}"),
                     report.Column("max_rel_diff", "max relative diff vs fp32", "{:.2e}"),
                     report.Column("within", "within tolerance"),
                     report.Column("skipped_steps", "skipped steps (loss scaler)")]
SPEED_COLUMNS = [report.Column("model", "model"), report.Column("option", "option"),
                 report.Column("params", "params", "{:,}"), report.Column("seq_len", "seq"),
                 report.Column("micro_batch_size", "micro-batch"),
                 report.Column("tokens_per_s", "tokens/s", "{:,.0f}"),
                 report.Column("tflops_per_device", "TFLOP/s", "{:.1f}"), report.Column("mfu", "MFU", "{:.1%}"),
                 report.Column("peak_memory", "peak allocated", "bytes"),
                 report.Column("peak_reserved", "peak reserved", "bytes"),
                 report.Column("formula_bytes", "model states (ZeRO formula)", "bytes"),
                 report.Column("wall_s", "wall s (build + steps)", "{:.0f}")]


@dataclass
class Results:
    """Everything the check has measured so far. Rows with an "error" field are variants that raised: every
    consumer of rows skips them (measured() does)."""
    smoke: bool
    precision_rtol: float
    fp16_initial_scale_power: int
    rows: list[dict] = field(default_factory=list)
    not_run: list[tuple[str, str]] = field(default_factory=list)   # (what, why)
    errors: list[tuple[str, str]] = field(default_factory=list)    # (what, "<type>: <its first line>")
    notes: list[str] = field(default_factory=list)
    sdpa_chosen: dict[str, str] | None = None
    sdpa_backends: list[dict] | None = None
    attention_shape: dict | None = None
    nccl: str = "not run"
    running: str | None = None  # the part in progress: what a kill interrupted
    started: float = field(default_factory=time.perf_counter)

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def measured(self, section: str) -> list[dict]:
        return [r for r in self.rows if r["section"] == section and "error" not in r]

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "started"} | {"wall_s": self.wall_s}


def save(results: Results, json_path: str, report_path: str, env: dict[str, str]) -> None:
    write_json_atomic(Path(json_path), results.to_json())
    write_report(report_path, results, env)


def with_commit(env: dict[str, str]) -> dict[str, str]:
    """report.environment's git commit, or COMMIT_ENV's where this tree is no git checkout."""
    if env.get("git commit", "").startswith("unknown") and os.environ.get(COMMIT_ENV):
        return env | {"git commit": f"{os.environ[COMMIT_ENV]} (from {COMMIT_ENV}; no .git on this machine)"}
    return env


# ---------------------------------------------------------------------------------------------- markdown
def _precision_block(r: Results) -> str:
    rows = r.measured("precision")
    steps = f"{len(rows[0]['losses'])} steps" if rows else "no run finished"
    return (f"## Precision: tiny-v3, ZeRO-1, one rank, {steps} on the same batches\n\n"
            f"Every step's loss within {r.precision_rtol:.0%} (relative) of fp32's; fp16 starts at loss scale "
            f"2^{r.fp16_initial_scale_power} so no early step is skipped.\n\n"
            + report.markdown_table(rows, PRECISION_COLUMNS))


def _speed_block(r: Results) -> str:
    return ("## Speed and memory: bf16, ZeRO-1, one rank, each option on and off\n\n"
            "MFU against the device's bf16 dense peak (training/metrics.PEAK_TFLOPS_BF16), FLOPs from "
            "models/flops.py (median step of the timed ones). Peak allocated: CUDA's max allocated (CPU: the "
            "process's peak RSS so far); peak reserved: what CUDA's caching allocator held at most (allocated plus "
            "cache and fragmentation). Each variant's engine is destroyed before the next is built. The ZeRO "
            "formula counts parameters, gradients and optimizer state only (activations, logits and workspace are "
            "the rest).\n\n" + report.markdown_table(r.measured("speed"), SPEED_COLUMNS))


def _attention_block(r: Results) -> str:
    if r.sdpa_backends is None:
        return "## Attention\n\nnot measured (see Errors and Not run)"
    a = r.attention_shape
    chosen = "\n".join(f"- {call}: **{name}**" for call, name in r.sdpa_chosen.items())
    return (f"## Attention: sdpa with MLA's head sizes (q/k {a['qk_dim']}, v {a['v_dim']}; {a['heads']} heads, "
            f"seq {a['seq']}, {a['dtype']})\n\nThe backend scaled_dot_product_attention dispatches to:\n\n{chosen}"
            f"\n\nEach backend forced (`torch.nn.attention.sdpa_kernel`), forward + backward ({a['timing']}):\n\n"
            + report.markdown_table(r.sdpa_backends, [report.Column(k, k) for k in r.sdpa_backends[0]]))


def _listed(items: list[tuple[str, str]], none: str = "nothing") -> str:
    return "\n".join(f"- {what}: {why}" for what, why in items) or none


def write_report(path: str, r: Results, env: dict[str, str]) -> None:
    smoke = " (--smoke: tiny models on the CPU; not GPU figures)" if r.smoke else ""
    not_run = list(r.not_run)
    if r.running:  # saved just before it started: still here, the process ended during it
        not_run.append((r.running, "started, but the check ended before it finished (killed at the time limit?)"))
    blocks = [
        f"# GPU check{smoke}",
        f"Written by `bash scripts/gpu_check.sh{' --smoke' if r.smoke else ''}` "
        f"(deepseek_ds/bench/gpu_check.py) after {r.wall_s:.0f} s.",
        "## Notes\n\n" + ("\n".join(f"- {n}" for n in r.notes) or "none"),
        _precision_block(r), _attention_block(r), _speed_block(r),
        f"## NCCL all-reduce\n\n{r.nccl}",
        "## Errors\n\n" + _listed(r.errors, "none") + ("\n\nTracebacks are in the log." if r.errors else ""),
        "## Not run\n\n" + _listed(not_run),
        "## Environment\n\n" + report.environment_markdown(env),
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    report.write_markdown(path, blocks)
