"""Each rank's communication per optimizer step, by collective kind: the bytes bench/comm_counter.py counts on a real
run (the tensor bytes a call passes on a rank: an all-reduce's tensor, a reduce-scatter's whole input, an
all-gather's whole output, an all-to-all's input, the tensors a rank sends), as DeepSpeed 0.19.8 and the toolkit
move them, modelled from the layout and the parameter list plan already builds. Groups of one rank move nothing and
count nothing. m micro-batches of b sequences of s tokens per rank and step, f bytes per element:

- data parallel (n = dp x sp ranks): ZeRO-0/1 all-reduce the trainable gradients once per step, ZeRO-2 after every
  micro-batch (it keeps only its partition); ZeRO-3 reduce-scatters them after every micro-batch. ZeRO-1/2
  all-gather the updated parameters once per step (the flat group, padded to 2 n elements); ZeRO-3 all-gathers each
  parameter above stage3_param_persistence_threshold in every micro-batch's forward, and again in its backward
  unless the parameters fetched in between stay under stage3_max_reuse_distance (from step 2 on, once DeepSpeed has
  traced the order), and the persistent ones once, after the optimizer step. Routed experts (AutoEP) do the same
  over the expert-data-parallel group (n / ep).
- pipeline: every stage but the last sends each micro-batch's hidden states (V4: its streams), position ids and
  the token ids or query mask later layers need on, every stage but the first sends the states' gradient back; the
  engine broadcasts the step's two fp32 losses over the pipeline.
- expert parallel: per MoE layer and micro-batch, the routed token copies (b s / sp x top-k x hidden) are
  all-to-all'd to their experts and back, forward and backward, and the per-expert counts (int32) once.
- tensor parallel: per decoder layer and micro-batch, the row-parallel outputs forward and the column-parallel
  inputs' gradients backward (_tensor_parallel_widths).
- sequence parallel (Ulysses): per decoder layer and micro-batch, q, k, v and the output all-to-all'd forward and
  their gradients backward: b s / sp x attention_widths each.
- the toolkit's own per step (training/loop.py): the metrics' SUM and MAX all-reduces (fp64) over all ranks, the
  loss's token counts (fp64) over the gradient group, DeepSpeed's gradient-norm scalar.
Step 1 moves more (ZeRO-3 gathers twice before its trace exists): these are the steps after it."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.layers import mtp_depth
from ..models.moe import AUX_TERMS, resolve_settings
from ..models.pipeline import partition_stages
from ..models.presets import num_routed_experts
from ..models.registry import family_of
from ..parallel import schedule_model
from ..training.router_stats import BIAS_STATS, moe_layer_indices
from ..utils.collectives import PLANNED_KINDS
from . import activations_v32
from .activations import layer_kinds, stream_width
from .estimate import Plan, attention_is_fused, estimate, layout_of
from .params import SpecParams, rank_params
from .states import PERSISTENCE_DEFAULT

REUSE_DISTANCE_DEFAULT = 1_000_000_000  # DeepSpeedZeroConfig.max_reuse_distance
FP64, FP32, INT32, INT64 = 8, 4, 4, 8


@dataclass(frozen=True)
class Transfer:
    kind: str    # one of PLANNED_KINDS
    group: str   # "data", "expert_data", "pipe", "expert", "tensor", "sequence" or "world"
    ranks: int   # the group's size
    bytes: float  # per rank and optimizer step, as comm_counter counts them

    @property
    def wire_bytes(self) -> float:
        """What a ring algorithm sends per rank: 2 (n-1)/n of an all-reduce's tensor, (n-1)/n of the others' (a
        send, all of it)."""
        n = self.ranks
        if self.kind == "send_recv":
            return self.bytes
        return self.bytes * (n - 1) / n * (2 if self.kind == "all_reduce" else 1)


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def _zero3_gathers(numels: list[int], n: int, persistence: int, reuse: int) -> int:
    """Elements one micro-batch all-gathers under ZeRO-3 (a parameter list in module order): the forward fetches
    every non-persistent one; the backward again those whose reuse (the parameters fetched after it in the forward
    and before it in the backward) exceeds the reuse distance."""
    total, after = 0, 0
    for numel in reversed(numels):
        if numel > persistence:
            total += _padded(numel, n) * (1 if 2 * after <= reuse else 2)
        after += numel
    return total


def transfers(cfg, ds: dict, plan: Plan, model: SpecParams, stage: int) -> list[Transfer]:
    """The communication of one rank of pipeline stage `stage` per optimizer step (every rank of a stage alike; EP
    ranks on average: routing decides each one's share)."""
    mcfg, lay = model.mcfg, plan.layout
    f = 2 if plan.precision in ("bf16", "fp16") else 4
    seq, m, b = cfg.data.seq_len, lay.grad_accum, lay.micro_batch
    schedule = cfg.parallel.pipeline_schedule
    bounds = model.bounds(partition_stages(lay.pipeline_stages, schedule), cfg.model.partition_method, seq)
    held = schedule_model.parts(schedule, lay.pipeline_stages, stage)  # DualPipeV: two half stages
    experts = num_routed_experts(mcfg)
    ep = lay.expert_parallel if experts else 1
    n, world = lay.data_parallel, lay.pipeline_stages * lay.data_parallel * lay.tensor_parallel
    params = [param for part in held for param in rank_params(model, bounds, part, ep, lay.tensor_parallel, cfg.lora,
                                                                cfg.indexer.stage)]
    zero = ds.get("zero_optimization", {})
    out: list[Transfer] = []

    def add(kind: str, group: str, ranks: int, nbytes: float) -> None:
        if ranks > 1 and nbytes:
            out.append(Transfer(kind, group, ranks, nbytes))

    for group, ranks, mine in (("data", n, [p for p in params if not p.expert]),
                               ("expert_data", n // ep, [p for p in params if p.expert])):
        trainable = sum(p.numel for p in mine if p.trainable)
        if lay.zero_stage == 3:
            add("reduce_scatter", group, ranks, m * f * sum(_padded(p.numel, ranks) for p in mine if p.trainable))
            persistence = int(zero.get("stage3_param_persistence_threshold", PERSISTENCE_DEFAULT))
            gathers = _zero3_gathers([p.numel for p in mine], ranks, persistence,
                                     int(zero.get("stage3_max_reuse_distance", REUSE_DISTANCE_DEFAULT)))
            # The persistent ones stay whole: gathered once, after the optimizer updated their partitions.
            persistent = sum(_padded(p.numel, ranks) for p in mine if p.trainable and p.numel <= persistence)
            add("all_gather", group, ranks, f * (m * gathers + persistent))
        else:
            add("all_reduce", group, ranks, (m if lay.zero_stage == 2 else 1) * f * trainable)
            if lay.zero_stage in (1, 2):
                add("all_gather", group, ranks, f * _padded(trainable, 2 * ranks))

    hidden = b * seq // lay.sequence_parallel * mcfg.hidden_size * f  # one micro-batch's hidden states on a rank
    # Between stages (models/layers.py EmbeddingPipe): the hidden states (V4: its hc_mult streams), the position
    # ids, the token ids where MTP or V4's hash routing needs them later, a trained indexer's query mask.
    states = b * seq * stream_width(mcfg) * f
    ids = b * seq * (INT64 * (2 if mtp_depth(mcfg) or family_of(mcfg).carries_token_ids else 1)
                     + (INT32 if activations_v32.trains(cfg.indexer.stage) else 0))
    # Forward: to the next rank; backward: the gradient to the previous one. DualPipeV's second half stage runs the
    # other way, so its ranks send both ways (the last rank turns a micro-batch around locally).
    downstream, upstream = stage < lay.pipeline_stages - 1, stage > 0
    for forward, backward in ([(downstream, upstream), (upstream, downstream)] if len(held) > 1
                              else [(downstream, upstream)]):
        if forward:
            add("send_recv", "pipe", 2, m * (states + ids))
        if backward:
            add("send_recv", "pipe", 2, m * states)
    add("broadcast", "pipe", lay.pipeline_stages, 2 * FP32)

    decoders = [i - 1 for part in held for i in range(bounds[part], bounds[part + 1])
                if 1 <= i <= mcfg.num_hidden_layers]
    moe = sum(1 for i in decoders if layer_kinds(mcfg)[i] == "moe")
    top_k = getattr(mcfg, "num_experts_per_tok", 0) or 0
    add("all_to_all", "expert", ep, m * moe * (4 * hidden * top_k + experts * INT32))
    tokens = b * seq // lay.sequence_parallel * f  # a micro-batch's tokens on a rank, times the element size
    add("all_reduce", "tensor", lay.tensor_parallel, m * tokens * sum(_tensor_parallel_widths(mcfg, kind == "moe")
                                                         for kind in (layer_kinds(mcfg)[i] for i in decoders)))
    add("all_to_all", "sequence", lay.sequence_parallel,
        m * len(decoders) * 2 * (b * seq // lay.sequence_parallel) * attention_widths(mcfg) * f)

    add("all_reduce", "world", world, FP64 * _metric_elements(cfg, mcfg, lay.pipeline_stages > 1))
    add("all_reduce", "data", n, FP64 * (1 + mtp_depth(mcfg)) + (8 if lay.zero_stage == 3 else FP32))
    # The gradient norm's square, summed again over the model-parallel ranks (stages, tensor ranks) and over the
    # expert-parallel ones.
    add("all_reduce", "pipe", lay.pipeline_stages, FP32)
    add("all_reduce", "tensor", lay.tensor_parallel, FP32)
    add("all_reduce", "expert", ep, FP32)
    return out


def _metric_elements(cfg, mcfg, pipeline: bool) -> int:
    """Elements of the step's SUM and MAX metric all-reduces (training/loop.py _reduced_metrics): the loss (not with
    a pipeline: its engine reports it), the MTP parts, the balance losses, each MoE layer's expert loads; the
    memory, the stop flag and each MoE layer's router-bias statistics."""
    layers = len(moe_layer_indices(mcfg))
    depth = mtp_depth(mcfg)
    settings = resolve_settings(cfg.moe, mcfg) if layers else None
    experts = num_routed_experts(mcfg)
    sums = ((0 if pipeline else 1) + (depth + 1 if depth else 0)
            + (len(AUX_TERMS) if settings and settings.has_aux else 0) + layers * experts)
    maxes = 2 + (layers * len(BIAS_STATS) if layers and family_of(mcfg).has_router_bias else 0)
    return sums + maxes


def _tensor_parallel_widths(mcfg, moe: bool) -> int:
    """Elements per token one decoder layer all-reduces under tensor parallelism, forward and backward: each
    row-parallel output (attention's o_proj, the MLP's down_proj) forward, the input gradient of each column-parallel
    matrix backward (DeepSpeed's AutoTP reduces them one by one: q, k, v; gate, up), and with MLA the rope key's
    gradient (models/tensor_parallel.py). An MoE layer's routed experts are whole: only its shared experts count."""
    h = mcfg.hidden_size
    if hasattr(mcfg, "kv_lora_rank"):
        attention = (getattr(mcfg, "q_lora_rank", None) or h) + mcfg.kv_lora_rank + mcfg.qk_rope_head_dim + h
    else:
        attention = 3 * h + h
    mlp = 3 * h if not moe or getattr(mcfg, "n_shared_experts", 0) else 0
    return attention + mlp


def attention_widths(mcfg) -> int:
    """Elements per token of one layer's q, k, v and attention output (all heads): what Ulysses moves each way."""
    h = mcfg.num_attention_heads
    if hasattr(mcfg, "kv_lora_rank"):
        return h * (2 * (mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim) + 2 * mcfg.v_head_dim)
    d = mcfg.hidden_size // h
    return (2 * h + 2 * mcfg.num_key_value_heads) * d


def comm_bytes(cfg, ds: dict, plan: Plan, model: SpecParams) -> list[dict[str, int]]:
    """Per pipeline stage, one rank's bytes per optimizer step by collective kind (every kind, zeros included)."""
    stages = []
    for stage in range(plan.layout.pipeline_stages):
        kinds = dict.fromkeys(PLANNED_KINDS, 0.0)
        for t in transfers(cfg, ds, plan, model, stage):
            kinds[t.kind] += t.bytes
        stages.append({k: round(v) for k, v in kinds.items()})
    return stages


def comm_json(cfg, ds: dict, plan: Plan, model: SpecParams) -> dict:
    """plan --json's `comm_bytes`: per stage, a rank's bytes per step by kind and their sum, and the bytes a ring
    algorithm puts on the wire for them (what the step time divides by the bandwidths)."""
    stages = comm_bytes(cfg, ds, plan, model)
    return {"definition": "tensor bytes a rank's collectives pass per optimizer step, once the first steps' one-time "
                          "set-up is done (bench comm measures them)",
            "stages": [{"stage": s, "total": sum(k.values()), "by_kind": k,
                        "wire_bytes": round(sum(t.wire_bytes for t in transfers(cfg, ds, plan, model, s)))}
                       for s, k in enumerate(stages)]}


def run_comm_bytes(cfg, ds: dict, world: int) -> list[dict[str, int]]:
    """comm_bytes of a run config and DeepSpeed JSON (validated) on `world` ranks: what bench comm compares."""
    model = SpecParams(cfg.model.hf_config)
    plan = estimate(cfg, ds, layout_of(cfg, ds, world), 2**50, attention_is_fused(cfg, cpu=True), model, cpu=True)
    return comm_bytes(cfg, ds, plan, model)
