"""A model as a flat list of DeepSpeed LayerSpecs, its partition into pipeline stages, and the two containers
that run it: DeepSpeed's PipelineModule (pipeline_stages > 1) and a plain sequential module (ZeRO 0-3)."""

from __future__ import annotations

import re
from functools import partial

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..utils.private_api import (
    PARTITION_LAYERS,
    pipeline_stage,
    set_attention_implementation,
    set_experts_implementation,
    set_stage_layers,
)
from . import flops
from .flops import LayerCost
from .layers import (
    DecoderLayerPipe,
    EmbeddingPipe,
    FinalNormPipe,
    LMHeadPipe,
    MTPLayerPipe,
    mtp_depth,
    mtp_embed_forward,
    tied_head_forward,
)
from .loss import IGNORE_INDEX, TokenWeightedLoss
from .presets import ModelConfigError, is_moe

# Seeds of layer i are base_seed * 1000 + i: fixed per layer, so the initial weights are the same whatever the layout.
_SEED_STRIDE = 1000


def layer_specs(config, seed: int | None) -> list:
    """embedding, one spec per decoder layer, final norm, [MTP: the tied embedding's second use, one spec per
    MTP depth,] head (tied to the embedding when the config says so). The embedding is a tied layer whenever a
    later stage uses it too, so DeepSpeed keeps the copies equal and sums their gradients."""
    def s(i):
        return None if seed is None else seed * _SEED_STRIDE + i

    n, depth = config.num_hidden_layers, mtp_depth(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = (TiedLayerSpec("embed", EmbeddingPipe, config, s(0), tied_weight_attr=["embed_tokens.weight"])
             if tied or depth else LayerSpec(EmbeddingPipe, config, s(0)))
    specs = [embed]
    specs += [LayerSpec(DecoderLayerPipe, config, i, s(i + 1)) for i in range(n)]
    specs.append(LayerSpec(FinalNormPipe, config, s(n + 1)))
    if depth:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, config, s(0), forward_fn=mtp_embed_forward,
                                   tied_weight_attr=["embed_tokens.weight"]))
        # Seeds n+3+k: the head keeps n+2, so adding MTP modules leaves the main model's initial weights unchanged.
        specs += [LayerSpec(MTPLayerPipe, config, n + k, s(n + 3 + k)) for k in range(depth)]
    if tied:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, config, s(0), forward_fn=tied_head_forward,
                                   tied_weight_attr=["embed_tokens.weight"]))
    else:
        specs.append(LayerSpec(LMHeadPipe, config, s(n + 2)))
    return specs


def mtp_tail_start(config) -> int | None:
    """Index of the first spec that must sit on the last pipeline stage (the MTP modules need the head), if any."""
    return config.num_hidden_layers + 2 if mtp_depth(config) else None


# ----------------------------------------------------------------------------------------------- partitioning
def layer_costs(config) -> list[LayerCost]:
    """Per-spec parameter counts, built on the meta device so real shapes (671B) cost no memory."""
    costs = []
    k = getattr(config, "num_experts_per_tok", 0) or 0
    for spec in layer_specs(config, seed=None):
        with torch.device("meta"):
            layer = spec.build()
        total = sum(p.numel() for p in layer.parameters())
        active = total
        if isinstance(spec, TiedLayerSpec) and spec.forward_fn is mtp_embed_forward:
            # With pipeline stages the last one holds its own copy of the tied embedding (and its optimizer state).
            name, active = "MTPEmbed(tied)", 0
        elif isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None:
            name, total = "LMHead(tied)", 0  # weights live with the embedding stage... unless on another stage
        else:
            name = type(layer).__name__
        if isinstance(layer, DecoderLayerPipe):
            kind = "MTP" if isinstance(layer, MTPLayerPipe) else ""
            name = f"{kind}{'MoE' if hasattr(layer.layer.mlp, 'experts') else 'Dense'}Layer{layer.layer_idx}"
            experts = getattr(layer.layer.mlp, "experts", None)
            if experts is not None:
                routed = sum(p.numel() for p in experts.parameters())
                active = total - routed + routed * k // config.n_routed_experts
        if isinstance(layer, EmbeddingPipe) and not (isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None):
            active = 0  # a lookup, no matmul
        costs.append(LayerCost(name, total, active, attention=isinstance(layer, DecoderLayerPipe)))
    return costs


def _stage_weights(costs: list[LayerCost], config, seq_len: int) -> list[float]:
    """Estimated share of one stage's time and memory for each layer: half compute (training FLOPs per token),
    half parameter memory."""
    compute = flops.layer_flops(costs, config, seq_len)
    total_c, total_m = sum(compute) or 1, sum(c.params for c in costs) or 1
    return [0.5 * cp / total_c + 0.5 * c.params / total_m for cp, c in zip(compute, costs)]


def partition(config, num_stages: int, method: str = "balanced", seq_len: int = 4096) -> list[int]:
    """Stage boundaries (num_stages + 1 indices into the spec list). Methods: balanced (compute and memory),
    uniform, parameters, type:REGEX (balance the number of matching layers), or an explicit list of boundaries
    '0,10,20,...' / per-stage layer counts 'counts:3,4,4,3'. Every layer is assigned: no layer is ever dropped."""
    costs = layer_costs(config)
    n = len(costs)
    # The MTP modules and the head form one unit (the tail) that the computed layouts keep on the last stage.
    tail = mtp_tail_start(config)
    units = n if tail is None else tail + 1

    def per_unit(values: list) -> list:
        return values if tail is None else values[:tail] + [sum(values[tail:])]

    if num_stages > units:
        raise ModelConfigError(f"parallel.pipeline_stages ({num_stages}) exceeds the number of pipeline layers ({units}"
                               + (", the MTP modules and the head counting as one)" if tail is not None else ")"))
    m = method.lower()
    if m == "balanced":
        parts = ds_utils.partition_balanced(per_unit(_stage_weights(costs, config, seq_len)), num_stages)
    elif m == "uniform":
        parts = ds_utils.partition_uniform(units, num_stages)
    elif m == "parameters":
        parts = ds_utils.partition_balanced(per_unit([c.params for c in costs]), num_stages)
    elif m.startswith("type:"):
        rx = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        parts = ds_utils.partition_balanced(per_unit([1 if rx.search(c.name) else 0 for c in costs]), num_stages)
    elif m.startswith("counts:"):
        counts = [int(x) for x in m.split(":", 1)[1].split(",")]
        parts = [0]
        for c in counts:
            parts.append(parts[-1] + c)
    elif re.fullmatch(r"\d+(,\d+)+", m):
        parts = [int(x) for x in m.split(",")]
    else:
        raise ModelConfigError(f"model.partition_method: unknown method {method!r}; use balanced, uniform, parameters, "
                               "type:REGEX, counts:a,b,... or explicit boundaries 0,a,b,...,N")
    parts = [int(p) for p in parts]  # DeepSpeed's helpers return numpy ints, which break seed_fn and JSON
    if tail is not None and not (m.startswith("counts:") or m[0].isdigit()) and parts[-1] == units:
        parts[-1] = n  # the tail unit back to its layers
    if len(parts) != num_stages + 1 or parts[0] != 0 or parts[-1] != n or any(a >= b for a, b in zip(parts, parts[1:])):
        raise ModelConfigError(f"model.partition_method {method!r} gives boundaries {parts}: need {num_stages + 1} "
                               f"strictly increasing indices from 0 to {n} ({n} layers: embedding, "
                               f"{config.num_hidden_layers} decoder layers, norm, "
                               + (f"MTP embedding, {mtp_depth(config)} MTP modules, " if tail is not None else "")
                               + "head)")
    if tail is not None and parts[-2] > tail:
        raise ModelConfigError(f"model.partition_method {method!r} gives boundaries {parts}, but the MTP modules "
                               f"(layers {tail}-{n - 2}) must be on the last stage with the head: the last stage must "
                               f"start at layer {tail} or earlier")
    return parts


def partition_table(config, parts: list[int], seq_len: int = 4096) -> str:
    costs = layer_costs(config)
    weights = _stage_weights(costs, config, seq_len)
    lines = [f"{'stage':>5}  {'layers':<36} {'params':>12} {'active':>12} {'est. share':>10}"]
    for st in range(len(parts) - 1):
        a, b = parts[st], parts[st + 1]
        names = f"{a}-{b - 1}: {costs[a].name}" + (f" .. {costs[b - 1].name}" if b - a > 1 else "")
        p = sum(c.params for c in costs[a:b])
        act = sum(c.active_params for c in costs[a:b])
        lines.append(f"{st:>5}  {names:<36} {_human(p):>12} {_human(act):>12} {sum(weights[a:b]):>9.1%}")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


# ----------------------------------------------------------------------------------------------- containers
class DeepSeekPipelineModule(PipelineModule):
    """PipelineModule with our partition (computed before construction, so the printed table is the real one)."""

    def __init__(self, specs, parts: list[int], **kwargs):
        self._fixed_parts = parts
        super().__init__(specs, partition_method="fixed", **kwargs)

    def use_fixed_parts(self, method="fixed"):
        """PipelineModule's partition step (it calls it as PARTITION_LAYERS, set below): ours, not its own."""
        self.parts = list(self._fixed_parts)
        stage_id = pipeline_stage(self)
        set_stage_layers(self, start=self.parts[stage_id], stop=self.parts[stage_id + 1])


# PipelineModule.__init__ partitions through a private method, with no public hook: ours takes its place.
setattr(DeepSeekPipelineModule, PARTITION_LAYERS, DeepSeekPipelineModule.use_fixed_parts)


class DeepSeekDualPipeVModule(DualPipeVModule, DeepSeekPipelineModule):
    """DeepSpeed's DualPipeV container (parallel.pipeline_schedule dualpipev) with our partition over 2 x
    pipeline_stages stages: rank r holds stage r and stage 2p-1-r, so rank 0 holds the embedding and the head (with
    MTP, the whole tail) and computes the loss. DualPipeVModule doubles its stage count, then partitions through
    DeepSeekPipelineModule's step (ours), then builds both of the rank's stages."""


def partition_stages(num_stages: int, schedule: str = "1f1b") -> int:
    """How many stages the model is cut into for `num_stages` pipeline ranks: DualPipeV cuts it into two per rank
    (without a pipeline, one)."""
    return 2 * num_stages if schedule == "dualpipev" and num_stages > 1 else num_stages


class SequentialLM(nn.Module):
    """All layers in one module, for the plain DeepSpeed engine (ZeRO 0-3 without pipeline parallelism).
    Built from the same specs and seeds as the pipeline, so both start from identical weights. `layers[i]` is the
    module of spec i, as a pipeline stage names it `i`; a tied spec's later uses (the tied head, the MTP modules'
    embedding) call the first use's module and hold an empty placeholder, so the indices stay aligned."""

    def __init__(self, specs, activation_checkpoint_interval: int = 0):
        super().__init__()
        layers, self._calls, tied = [], [], {}
        for spec in specs:
            if isinstance(spec, TiedLayerSpec) and spec.key in tied:
                layers.append(nn.Identity())
                self._calls.append(partial(spec.forward_fn, tied[spec.key]))
                continue
            layers.append(spec.build())
            self._calls.append(None)
            if isinstance(spec, TiedLayerSpec):
                tied[spec.key] = layers[-1]
        self.layers = nn.ModuleList(layers)
        self.ckpt_interval = activation_checkpoint_interval

    def forward(self, inputs):
        """inputs: input_ids, or (input_ids, position_ids) (see split_micro_batch)."""
        x = inputs
        for i, (layer, call) in enumerate(zip(self.layers, self._calls)):
            if call is not None:
                x = call(x)
            elif (self.ckpt_interval and type(layer) is DecoderLayerPipe and self.training
                  and i % self.ckpt_interval == 0):
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


def split_micro_batch(micro_batch: tuple, mtp: bool = False, query_mask: bool = False) -> tuple:
    """(model inputs, labels) of a micro-batch (input_ids, labels[, position_ids]): the inputs are input_ids, or
    (input_ids, position_ids) for packed sequences, which both containers' first layer takes (DeepSpeed's pipeline
    hands the first element to the first stage, the second to the loss). With MTP depths (`mtp`) the loss also
    gets the position ids, as (labels, position_ids), to keep each depth's targets inside a document. With
    `query_mask` (trainable DeepSeek-V3.2 indexers, whose loss counts the queries with a target) the inputs are
    (input_ids, position_ids, labels != -100 as int32), position ids counting from 0 in each row when unpacked; the
    pipeline carries the mask to every stage (an integer tensor: no gradient travels back)."""
    if query_mask:
        input_ids, labels, *packed = micro_batch
        position_ids = packed[0] if packed else torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous()
        inputs = (input_ids, position_ids, (labels != IGNORE_INDEX).to(torch.int32))
        return inputs, ((labels, position_ids) if mtp and packed else labels)
    if len(micro_batch) == 2:
        return micro_batch
    input_ids, labels, position_ids = micro_batch
    return (input_ids, position_ids), ((labels, position_ids) if mtp else labels)


def to_device(inputs, device):
    """A tensor or tuple of tensors (split_micro_batch's inputs or labels) on `device`. Host tensors reach a GPU
    through pinned memory without blocking: a blocking copy waits for all the work queued before it (a sync)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if torch.device(device).type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)
    return tuple(move(t) for t in inputs) if isinstance(inputs, tuple) else move(inputs)


def build_model(config, num_stages: int, seed: int, parts: list[int] | None = None, topology=None,
                activation_checkpoint_interval: int = 0, loss_fn: TokenWeightedLoss | None = None,
                schedule: str = "1f1b") -> nn.Module:
    """num_stages: pipeline ranks; parts: partition_stages(num_stages, schedule) + 1 boundaries (schedule
    dualpipev: DeepSpeed's DualPipeV container, which the engine runs with its DualPipeV schedule)."""
    specs = layer_specs(config, seed)
    if num_stages == 1 and topology is None:
        return SequentialLM(specs, activation_checkpoint_interval)
    container = DeepSeekDualPipeVModule if schedule == "dualpipev" else DeepSeekPipelineModule
    return container(
        specs, parts=parts or partition(config, partition_stages(num_stages, schedule)),
        num_stages=None if topology else num_stages,
        topology=topology, loss_fn=loss_fn, activation_checkpoint_interval=activation_checkpoint_interval,
        # Reentrant checkpointing of the embedding (first) layer breaks the graph: only decoder layers qualify.
        checkpointable_layers=["DecoderLayerPipe"])


def prepare_config(config, attn_implementation: str = "sdpa", experts_implementation: str = "grouped_mm"):
    """Kernel choices live on the config in transformers; set them once here for every layer."""
    set_attention_implementation(config, attn_implementation)
    if is_moe(config):
        set_experts_implementation(config, experts_implementation)
    config.use_cache = False
    return config


def defer_logits(model: nn.Module) -> None:
    """In training the heads hand the loss a Projection, which it projects a chunk of tokens at a time (models/loss.py):
    the full logits never exist. Not for ZeRO-3: it gathers a weight only inside its module's forward and backward."""
    for m in model.modules():
        if isinstance(m, (LMHeadPipe, EmbeddingPipe)):
            m.defer_logits = True


def compile_layers(model: nn.Module) -> int:
    """train.compile: torch.compile each decoder layer's transformers block in place (regional compilation, as
    torchtitan does): identical blocks share one compiled graph, so compiling costs one layer's time, not the model's;
    parameter names (checkpoints, HF names) do not change. Returns the number of blocks compiled."""
    blocks = [m.layer for m in model.modules() if isinstance(m, DecoderLayerPipe)]
    for block in blocks:
        block.compile()
    return len(blocks)


def local_layers(model: nn.Module) -> list[nn.Module]:
    """The pipeline layers this rank holds (all of them for SequentialLM, its stage's for a PipelineModule)."""
    kinds = (EmbeddingPipe, DecoderLayerPipe, FinalNormPipe, LMHeadPipe)
    return [m for m in model.modules() if isinstance(m, kinds)]
