"""The plan as people and programs read it: a per-rank table with the verdict, the --json object, the one-line
verdict validate and train print, and the ranked --search list."""

from __future__ import annotations

from ..utils.fmt import human_bytes, markdown_table, text_table
from .estimate import CPU_RUNTIME_BYTES, TERMS, Plan, layout_dict, layout_line
from .steptime import StepTime

RUNTIME_NOTE = (f"runtime: {human_bytes(CPU_RUNTIME_BYTES)} a CPU rank's process holds besides its tensors (the "
                "interpreter, torch, DeepSpeed, the allocator's slack; measured on tiny-v3 runs), which a GPU's "
                "allocator peak does not count")


def verdict(plan: Plan) -> str:
    r = plan.fullest
    word = "FITS" if plan.fits else "DOES NOT FIT"
    return (f"plan: {word}: the fullest rank ({r.rank}, stage {r.stage}) needs {human_bytes(r.total)} of "
            f"{human_bytes(plan.gpu_memory)} ({r.total / plan.gpu_memory:.0%}); largest term: {r.largest} "
            f"{human_bytes(getattr(r, r.largest))} [{layout_line(plan.layout)}]")


def table(plan: Plan, markdown: bool = False) -> str:
    """One row per rank; a `runtime` column on the CPU accelerator only."""
    terms = TERMS + (("runtime",) if any(r.runtime for r in plan.ranks) else ())
    rows = [[str(r.rank), str(r.stage), *(human_bytes(getattr(r, t)) for t in terms), human_bytes(r.total), r.largest]
            for r in plan.ranks]
    return (markdown_table if markdown else text_table)(rows, ["rank", "stage", *terms, "total", "largest"])


def as_json(plan: Plan) -> dict:
    return {"fits": plan.fits, "gpu_memory_bytes": plan.gpu_memory, "model": plan.model, "precision": plan.precision,
            "optimizer": plan.optimizer, "layout": layout_dict(plan.layout),
            "ranks": [{"rank": r.rank, "stage": r.stage, "params_bytes": r.params, "grads_bytes": r.grads,
                       "optimizer_bytes": r.optimizer, "activation_bytes": r.activations, "buffers_bytes": r.buffers,
                       "offloaded_bytes": r.offloaded, "runtime_bytes": r.runtime, "total_bytes": r.total}
                      for r in plan.ranks]}


def why(plan: Plan, t: StepTime) -> str:
    schedule = f" ({t.schedule})" if plan.layout.pipeline_stages > 1 else ""
    return (f"{t.total_s:.2f} s/step, {t.tokens_per_s:,.0f} tokens/s: compute {t.compute_s:.2f} s, bubble "
            f"{t.bubble:.0%}{schedule}, communication {t.comm_s:.2f} s; fullest rank {human_bytes(plan.fullest.total)}")


def ranking(found: list[tuple[Plan, StepTime]], top: int) -> str:
    rows = [[str(i + 1), layout_line(p.layout), why(p, t)] for i, (p, t) in enumerate(found[:top])]
    return text_table(rows, ["#", "layout", "why"], align=("right", "left", "left"))


def comm_line(comm: dict) -> str:
    """The busiest stage's bytes per rank and step by collective (plan --json's comm_bytes)."""
    s = max(comm["stages"], key=lambda stage: stage["wire_bytes"])
    kinds = ", ".join(f"{k.replace('_', '-')} {human_bytes(v)}" for k, v in s["by_kind"].items() if v)
    where = f" (stage {s['stage']}, the busiest)" if len(comm["stages"]) > 1 else ""
    return f"communication per rank and step{where}: {kinds}; {human_bytes(s['wire_bytes'])} on the wire"
