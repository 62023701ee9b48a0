"""Estimated optimizer-step time of a layout, and the search over every layout validate() accepts for a GPU count.

time = the slowest stage's compute (training FLOPs per token from models.flops, the one formula, less the weight
gradients of LoRA's frozen base, at a stated MFU of the GPU's peak) stretched by parallel.pipeline_schedule's bubble
b, time / (1 - b), for p stages and m micro-batches (parallel/schedule_model.py: 1F1B (p-1)/(m+p-1); ZB-H1
(p-1)/(3m+p-1) and DualPipeV (5p-6)/(6m+5p-6), taking a layer's forward, input gradient and weight gradient to cost
alike; DualPipeV's slowest rank is the one whose two half stages compute most), plus the communication a step must
move at a stated bandwidth per GPU, not overlapped (an upper bound): plan/comm.py's transfers of each rank (the bytes
bench comm measures), each at a ring algorithm's wire bytes (2 (n-1)/n of an all-reduce, (n-1)/n of the other
collectives, a send whole), the expert, tensor and sequence groups at the bandwidth inside a node when they fit in
one, the rest between nodes; the slowest stage's. Sequence ranks split a replica's tokens: each computes 1/sp of
them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from ..config import ConfigError, RunConfig, validate
from ..models import flops
from ..models.pipeline import partition_stages
from ..models.presets import num_routed_experts
from ..parallel import schedule_model
from ..parallel.schedule_rules import min_micro_batches
from ..training.metrics import PEAK_TFLOPS_BF16
from .comm import transfers
from .estimate import Plan, attention_is_fused, estimate, layout_of
from .params import SpecParams, lora_active

LOCAL_GROUPS = ("expert", "tensor", "sequence")


@dataclass(frozen=True)
class Gpu:
    name: str
    device: str          # its key in training.metrics' bf16 dense peak table (the name torch reports contains it)
    memory: int          # bytes: the datasheet's GB read as --gpu-memory reads it (GiB)

    @property
    def peak_tflops(self) -> float:
        return dict(PEAK_TFLOPS_BF16)[self.device]


# --gpu presets: memory from the vendors' datasheets (NVIDIA H100 SXM5 80 GB, H200 SXM 141 GB, A100 SXM4 80 GB, L40S
# 48 GB, GeForce RTX 4090 24 GB); the bf16 dense peaks are the table training's MFU uses (the same datasheets,
# without their 2:4-sparsity doubling).
GPUS = {
    "h100": Gpu("H100 SXM", "H100", 80 * 2**30),
    "h200": Gpu("H200 SXM", "H200", 141 * 2**30),
    "a100": Gpu("A100 80GB SXM", "A100", 80 * 2**30),
    "l40s": Gpu("L40S", "L40S", 48 * 2**30),
    "4090": Gpu("GeForce RTX 4090", "RTX 4090", 24 * 2**30),
}
DEFAULT_GPU = "h100"  # the peak a plan assumes without --gpu or --peak-tflops


@dataclass(frozen=True)
class Hardware:
    peak_tflops: float   # per GPU, dense, in the run's precision
    mfu: float           # the fraction of it the compute reaches
    bandwidth: float        # bytes/s per GPU for collectives between nodes
    intra_bandwidth: float  # bytes/s per GPU inside a node
    gpus_per_node: int


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    bubble: float        # the schedule's idle share of the pipelined window
    schedule: str        # parallel.pipeline_schedule
    comm_s: float
    tokens: int          # per optimizer step, all ranks

    @property
    def total_s(self) -> float:
        return self.compute_s / (1 - self.bubble) + self.comm_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def step_time(cfg: RunConfig, plan: Plan, hw: Hardware, model: SpecParams, ds: dict | None = None) -> StepTime:
    """`ds`: the DeepSpeed JSON (ZeRO-3's persistence threshold and reuse distance; None: DeepSpeed's defaults)."""
    mcfg, lay = model.mcfg, plan.layout
    seq = cfg.data.seq_len
    schedule = cfg.parallel.pipeline_schedule
    bounds = model.bounds(partition_stages(lay.pipeline_stages, schedule), cfg.model.partition_method, seq)
    per_layer = flops.layer_flops(model.costs, mcfg, seq)
    if cfg.lora.r:
        # A weight's 6 FLOPs per element and token are 2 forward, 2 for its input's gradient and 2 for its own
        # gradient; LoRA's frozen base weights skip the last, the adapters (and modules_to_save) take all 6.
        per_layer = [f - 2 * frozen + 6 * adapters
                     for f, (frozen, adapters) in zip(per_layer, lora_active(model, cfg.lora))]
    replica_tokens = lay.micro_batch * lay.grad_accum * seq
    part_flops = [sum(per_layer[a:b]) for a, b in zip(bounds, bounds[1:])]
    stage_flops = [sum(part_flops[part] for part in schedule_model.parts(schedule, lay.pipeline_stages, stage))
                   for stage in range(lay.pipeline_stages)]
    split = lay.tensor_parallel * lay.sequence_parallel  # ranks that share a replica's tokens within a stage
    compute = max(stage_flops) * replica_tokens / split / (hw.peak_tflops * 1e12 * hw.mfu)
    bubble = schedule_model.bubble(schedule, lay.pipeline_stages, lay.grad_accum)
    # Expert, tensor and sequence groups are consecutive ranks: inside one node when they fit in it; the data,
    # expert-data and pipeline groups span nodes.
    inside = lay.expert_parallel * lay.tensor_parallel * lay.sequence_parallel <= hw.gpus_per_node
    comm = max(sum(t.wire_bytes / (hw.intra_bandwidth if inside and t.group in LOCAL_GROUPS else hw.bandwidth)
                   for t in transfers(cfg, ds or {}, plan, model, stage)) for stage in range(lay.pipeline_stages))
    return StepTime(compute_s=compute, bubble=bubble, schedule=schedule, comm_s=comm,
                    tokens=lay.micro_batch * lay.grad_accum * lay.replicas * seq)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: RunConfig, ds: dict, world: int, mcfg) -> list[tuple[RunConfig, dict]]:
    """Every (pp, ep, tp, sp, zero) of `world` ranks that validate() accepts with the run's batch sizes."""
    out = []
    experts = num_routed_experts(mcfg)
    for pp in _divisors(world):
        if pp > mcfg.num_hidden_layers + 3:
            break
        for tp, sp in ((t, s) for t in (1, 2, 4, 8) for s in (1, 2, 4, 8) if (world // pp) % (t * s) == 0):
            ranks = world // (pp * tp)  # data x sequence: expert parallelism shards over them
            for ep in (e for e in _divisors(ranks) if experts and experts % e == 0) if experts else [1]:
                for zero in (0, 1) if pp > 1 else (0, 1, 2, 3):
                    c = dataclasses.replace(cfg, parallel=dataclasses.replace(
                        cfg.parallel, pipeline_stages=pp, tensor_parallel=tp, expert_parallel=ep,
                        sequence_parallel=sp))
                    d = copy.deepcopy(ds)
                    d.setdefault("zero_optimization", {})["stage"] = zero
                    try:
                        validate(c, d, world, cuda_available=True, files=False)
                    except ConfigError:
                        continue
                    out.append((c, d))
    return out


def search(cfg: RunConfig, ds: dict, world: int, gpu_memory: int, hw: Hardware, cpu: bool,
           model: SpecParams) -> list[tuple[Plan, StepTime]]:
    """Every valid layout that fits, fastest first (`cpu`: on DeepSpeed's CPU accelerator); not those with fewer
    micro-batches than the run's pipeline schedule runs."""
    ranked = []
    for c, d in candidates(cfg, ds, world, model.mcfg):
        layout = layout_of(c, d, world)
        if layout.grad_accum < min_micro_batches(c.parallel.pipeline_schedule, layout.pipeline_stages):
            continue
        plan = estimate(c, d, layout, gpu_memory, attention_is_fused(c, cpu), model, cpu=cpu)
        if plan.fits:
            ranked.append((plan, step_time(c, plan, hw, model, d)))
    return sorted(ranked, key=lambda ps: ps[1].total_s)
