"""The DeepSeek-V3 arithmetic of `bench checkpoint`: a checkpoint's bytes in the layout of DeepSeek-V3's report
(PP16 x EP64 x ZeRO-1 data parallelism on 2,048 GPUs), per rank from `deepseek-ds plan --json`, and the time a save
and a resume take at stated bandwidths, synchronous and with checkpoint.async. The bandwidths are stated, not
measured here."""

from __future__ import annotations

import json
import subprocess
import sys

from ..utils.fmt import text_table

V3_RECIPE = "recipes/deepseek-v3.yaml"
V3_LAYOUT = "pp=16,ep=64,tp=1,zero=1,micro=1"
V3_GPUS = 2048
GPUS_PER_NODE = 8
PLAN_COMMAND = [sys.executable, "-m", "deepseek_ds", "plan", "--config", V3_RECIPE, "--gpus", str(V3_GPUS),
                "--gpu-memory", "80GB", "--layout", V3_LAYOUT, "--json"]
STORAGE_GBPS = (100.0, 1000.0)  # a cluster's aggregate shared-storage bandwidth: a parallel filesystem, a large one
D2H_GBPS = 25.0  # one GPU's copy into pinned host memory over PCIe Gen5 x16 (about half its 64 GB/s peak)
ADAM_BYTES, WEIGHT_BYTES = 12, 2  # a parameter's fp32 master weight and Adam moments; its bf16 weight
GIB = 2**30


def v3_checkpoint() -> dict:
    """Bytes of a DeepSeek-V3 checkpoint in its report's layout: `total` (every rank's optimizer shard, plus the bf16
    weights, written once), `fullest` (the most one rank writes: a stage's first data-parallel rank, which writes its
    stage's weights and its optimizer shard) and `per_rank_mean`. plan lists each stage's fullest rank; the ranks of
    a stage hold equal optimizer shards."""
    plan = json.loads(subprocess.run(PLAN_COMMAND, capture_output=True, text=True, check=True).stdout)
    ranks, layout = plan["ranks"], plan["layout"]
    world = layout["pp"] * layout["dp"] * layout["tp"] * layout["sp"]
    optimizer = sum(r["optimizer_bytes"] for r in ranks) * (world // layout["pp"])
    params = optimizer / ADAM_BYTES
    weights = WEIGHT_BYTES * params
    fullest = max(ranks, key=lambda r: r["params_bytes"] + r["optimizer_bytes"])
    return {"params": params, "total": weights + optimizer, "weights": weights, "optimizer": optimizer,
            "fullest": fullest["params_bytes"] + fullest["optimizer_bytes"], "fullest_rank": fullest["rank"],
            "per_rank_mean": (weights + optimizer) / world, "world": world,
            "layout": ",".join(f"{k}={layout[k]}" for k in ("pp", "ep", "tp", "zero", "dp"))}


def projection_table(v3: dict, save_vs_raw: float, resume_vs_raw: float) -> str:
    """Seconds of a save and a resume of the whole checkpoint at each STORAGE_GBPS (at this machine's measured
    fraction of raw I/O), and checkpoint.async's copy of the fullest rank's state to pinned host memory (which
    overlaps the next step's forward and backward: its update waits only for what is left of it)."""
    rows = []
    for gbps in STORAGE_GBPS:
        raw = v3["total"] / (gbps * 1e9)
        rows.append([f"{gbps:g} GB/s storage", f"{raw:,.0f}", f"{raw / save_vs_raw:,.0f}",
                     f"{v3['fullest'] / (D2H_GBPS * 1e9):.2f}", f"{raw:,.0f}", f"{raw / resume_vs_raw:,.0f}"])
    return text_table(rows, ["bandwidth", "raw write (s)", "sync save (s)", "async: copy (s)",
                             "raw read (s)", "resume (s)"])


def projection_text(v3: dict, save_vs_raw: float, resume_vs_raw: float) -> str:
    host = GPUS_PER_NODE * v3["fullest"] / GIB
    return "\n".join([
        f"DeepSeek-V3 ({v3['params'] / 1e9:,.0f}B parameters with its MTP module) on {v3['world']} GPUs, "
        f"{v3['layout']} (`{' '.join(['deepseek-ds', *PLAN_COMMAND[3:]])}`):",
        f"  checkpoint {v3['total'] / 1e12:.2f} TB: bf16 weights {v3['weights'] / 1e12:.2f} TB + fp32 master weights "
        f"and Adam moments {v3['optimizer'] / 1e12:.2f} TB; {v3['per_rank_mean'] / GIB:.2f} GiB a rank on average, "
        f"{v3['fullest'] / GIB:.2f} GiB on the fullest (rank {v3['fullest_rank']})",
        f"  checkpoint.async holds one copy of a rank's files in pinned host memory (up to {host:.0f} GiB on a node "
        f"of {GPUS_PER_NODE} GPUs), copied at {D2H_GBPS:g} GB/s a GPU while the next step's forward and backward "
        "run: its update waits only when the copy takes longer",
        f"  times at this machine's measured save {save_vs_raw:.2f}x and resume {resume_vs_raw:.2f}x of raw I/O:",
        projection_table(v3, save_vs_raw, resume_vs_raw)])
