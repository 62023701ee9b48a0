"""One layout's per-rank estimate: the fullest rank of every pipeline stage, each with its parameter, gradient and
optimizer bytes (states.py, exact), activations (activations.py), communication buffers, on the CPU accelerator the
runtime's resident memory, and the total against the GPU's memory (what the training loop's memory_gb reports as the
rank's peak: CUDA's peak allocated bytes, on the CPU the process's peak resident set)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RunConfig, offloads, precision, zero_stage
from ..models.muon import is_muon
from ..models.pipeline import partition_stages
from ..models.presets import num_routed_experts
from ..parallel import schedule_model
from ..parallel.degrees import Layout
from . import activations
from .params import SpecParams, rank_params
from .states import PERSISTENCE_DEFAULT, ZeroSettings, state_bytes

# DeepSpeedZeroConfig's defaults (deepspeed/runtime/zero/config.py), for a JSON that leaves them out.
REDUCE_BUCKET_DEFAULT = int(5e8)
PREFETCH_BUCKET_DEFAULT = int(5e7)
TERMS = ("params", "grads", "optimizer", "activations", "buffers")
# A CPU rank's resident set holds more than its tensors: the interpreter, torch, DeepSpeed and the toolkit (453 MiB
# before the first step of a tiny-v3 rank, docs/bench/sequence.md, its 8 MiB of parameters included) and the
# allocator's slack in the steps (50-110 MiB over the modelled tensors in the same runs). CUDA's allocator peak
# counts neither (nor the CUDA context, which the GPU's memory must hold besides).
CPU_RUNTIME_BYTES = 512 * 2**20


@dataclass(frozen=True)
class RankEstimate:
    rank: int
    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    offloaded: int  # model-state bytes in host memory (offload), not counted in `total`
    runtime: int = 0  # the CPU accelerator's process runtime (CPU_RUNTIME_BYTES); 0 on a GPU

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers + self.runtime
                - self.offloaded)

    @property
    def largest(self) -> str:
        return max(TERMS, key=lambda t: getattr(self, t))


@dataclass
class Plan:
    model: str
    precision: str
    layout: Layout
    gpu_memory: int
    ranks: list[RankEstimate]
    optimizer: str = "AdamW"  # whose states the optimizer column counts: AdamW's, or DeepSpeed's Muon (with AdamW)

    @property
    def fullest(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.fullest.total <= self.gpu_memory


def layout_of(cfg: RunConfig, ds: dict, world: int) -> Layout:
    """The layout train.py runs for this config and world size (validate() has checked it)."""
    p, dp = cfg.parallel, cfg.data_parallel_size(world)
    return Layout(dp * p.sequence_parallel, p.pipeline_stages, p.tensor_parallel, p.sequence_parallel,
                  p.expert_parallel, zero_stage(ds), precision(ds), micro_batch=cfg.train.micro_batch_size,
                  grad_accum=cfg.grad_accum_steps(dp))


def layout_dict(lay: Layout) -> dict:
    """A plan's layout as `plan --json` gives it."""
    return {"pp": lay.pipeline_stages, "ep": lay.expert_parallel, "tp": lay.tensor_parallel,
            "sp": lay.sequence_parallel, "zero": lay.zero_stage, "dp": lay.replicas, "micro": lay.micro_batch,
            "grad_accum": lay.grad_accum}


def layout_line(lay: Layout) -> str:
    """A plan's layout in one line of its report."""
    return (f"pp={lay.pipeline_stages},ep={lay.expert_parallel},tp={lay.tensor_parallel},sp={lay.sequence_parallel},"
            f"zero={lay.zero_stage},micro={lay.micro_batch} (dp {lay.replicas}, grad-accum {lay.grad_accum})")


def element_bytes(ds: dict) -> int:
    """Bytes of a parameter, gradient and activation element in the run's precision."""
    return 2 if precision(ds) in ("bf16", "fp16") else 4


def zero_settings(ds: dict, stage: int, param_bytes: int) -> ZeroSettings:
    zero = ds.get("zero_optimization", {})
    return ZeroSettings(stage=stage, param_bytes=param_bytes,
                        persistence_threshold=int(zero.get("stage3_param_persistence_threshold", PERSISTENCE_DEFAULT)),
                        offload_optimizer=offloads(ds, "optimizer"), offload_params=offloads(ds, "param"),
                        muon=is_muon(ds))


def buffer_bytes(ds: dict, layout: Layout, param_bytes: int, boundary_bytes: int, touched: int | None = None) -> int:
    """Communication buffers: ZeRO's gradient reduction bucket(s) (reduce_bucket_size elements of the gradients'
    dtype; two with overlap_comm), ZeRO-3's parameter prefetch bucket, and a pipeline stage's send and receive
    buffers (activations forward, their gradients backward). `touched`: on the CPU, where a bucket's pages become
    resident only once written, the most elements a bucket can hold (the stage's parameters); on a GPU the
    allocator counts the whole bucket."""
    zero = ds.get("zero_optimization", {})

    def bucket_bytes(key: str, default: int) -> int:
        elements = int(zero.get(key, default))
        return (elements if touched is None else min(elements, touched)) * param_bytes

    overlap = bool(zero.get("overlap_comm", layout.zero_stage == 3))
    out = 0
    if layout.zero_stage in (1, 2):
        out += bucket_bytes("reduce_bucket_size", REDUCE_BUCKET_DEFAULT) * (2 if overlap else 1)
    elif layout.zero_stage == 3:
        out += (bucket_bytes("reduce_bucket_size", REDUCE_BUCKET_DEFAULT)
                + bucket_bytes("stage3_prefetch_bucket_size", PREFETCH_BUCKET_DEFAULT))
    if layout.pipeline_stages > 1:
        out += 2 * boundary_bytes
    return out


def attention_is_fused(cfg: RunConfig, cpu: bool) -> bool:
    """Whether attention runs a fused kernel that keeps no score matrix: not on the CPU (MLA's unequal query and
    value head dims take torch's math kernel there), nor with model.attn_implementation=eager."""
    return not cpu and cfg.model.attn_implementation != "eager"


def estimate(cfg: RunConfig, ds: dict, layout: Layout, gpu_memory: int, fused_attention: bool,
             model: SpecParams | None = None, cpu: bool = False) -> Plan:
    """Per-rank bytes of `layout` (the run's own, or one from --layout / --search) for this run config; `cpu`: on
    DeepSpeed's CPU accelerator, where a rank's peak is its process's resident set (CPU_RUNTIME_BYTES more, and only
    the written part of a communication bucket)."""
    mcfg = model.mcfg if model else cfg.model.hf_config
    model = model or SpecParams(mcfg)
    f = element_bytes(ds)
    z = zero_settings(ds, layout.zero_stage, f)
    schedule = cfg.parallel.pipeline_schedule
    # DualPipeV cuts the model into 2 pp half stages, rank r holding r and 2 pp - 1 - r (models/pipeline.py).
    pp, tp, sp = layout.pipeline_stages, layout.tensor_parallel, layout.sequence_parallel
    bounds = model.bounds(partition_stages(pp, schedule), cfg.model.partition_method, cfg.data.seq_len)
    ep = layout.expert_parallel if num_routed_experts(mcfg) else 1
    # A sequence rank holds seq_len / sp tokens of each sequence, and attends over the whole sequence for heads / sp
    # heads: per token of its own, what a rank without SP keeps per token (the score matrix's seq_len columns too).
    tokens = layout.micro_batch * cfg.data.seq_len // sp
    boundary = tokens * activations.stream_width(mcfg) * f
    ranks = []
    for stage in range(pp):
        held = schedule_model.in_flight(schedule, pp, stage, layout.grad_accum)
        params = [param for part in schedule_model.parts(schedule, pp, stage)
                  for param in rank_params(model, bounds, part, ep, tp, cfg.lora, cfg.indexer.stage)]
        acts, recompute = 0, 0
        for part, micro_batches in held:
            saved, transient = activations.stage_micro_batch_bytes(
                mcfg, bounds, part, tokens, cfg.data.seq_len, f, tp, fused_attention,
                cfg.model.activation_checkpoint_interval, with_loss=True, zero=layout.zero_stage, sp=sp,
                tiled_mlp=cfg.train.tiled_mlp, indexer=cfg.indexer.stage)
            acts += saved * micro_batches
            recompute = max(recompute, transient)  # once per rank: one backward runs at a time
        acts += recompute
        # ZeRO-2's slices hold different parameters whole (and ZeRO 1/2's Muon momentum the matrices overlapping each
        # slice): the fullest data-parallel rank decides.
        n = layout.data_parallel
        dp_ranks = range(n) if layout.zero_stage == 2 or (z.muon and layout.zero_stage == 1) else range(1)
        dp_rank, states = max(((d, state_bytes(params, z, n, ep, d)) for d in dp_ranks),
                              key=lambda ds_: ds_[1].params + ds_[1].grads + ds_[1].optimizer)
        touched = sum(p.numel for p in params) if cpu else None
        ranks.append(RankEstimate(rank=(stage * n + dp_rank) * tp, stage=stage, params=states.params,
                                  grads=states.grads, optimizer=states.optimizer, activations=acts,
                                  buffers=buffer_bytes(ds, layout, f, boundary, touched), offloaded=states.offloaded,
                                  runtime=CPU_RUNTIME_BYTES if cpu else 0))
    name = cfg.model.preset or cfg.model.path
    return Plan(model=name, precision=precision(ds), layout=layout, gpu_memory=gpu_memory, ranks=ranks,
                optimizer="Muon" if z.muon else "AdamW")
