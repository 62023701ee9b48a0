"""DeepSeekMoE load balancing that transformers lacks, and the DeepSpeed AutoEP section for expert parallelism.

- Auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2): after each optimizer step every router's
  `e_score_correction_bias` moves by gamma * sign(mean load - load), the load being the tokens routed to each
  expert in that step, summed over the data-parallel ranks (which see different data).
- Sequence-wise balance loss (V3 eq. 17-20; the same per-sequence formula is V2's expert-level loss, eq. 12-14,
  on softmax scores), V2's device-level balance loss (eq. 15-17) and V2's communication balance loss (eq. 18-20).

Everything is attached with forward hooks, so the model stays transformers' own: a hook on each router counts the
load (`ExpertLoad`, which the per-step metrics read too) and keeps its logits and top-k choice, a hook on the MoE
block (which sees the (batch, seq, hidden) shape the router does not) computes the balance loss and ties it to the
block's output with `AuxLossGrad`. That identity sends a fixed gradient into the loss in backward, wherever the
block's output takes part in backward: the plain engine and every pipeline stage alike, with no change to the LM
loss or to what travels between stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from deepspeed.moe.ep_router import TokenChoiceTopKRouter
from torch import nn
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter

from ..utils.private_api import in_backward
from .aux_grad import AuxLossGrad
from .registry import family_of

# Each returns (logits, weights, chosen experts). V4's hash routers choose by a fixed token table (tid2eid): their load
# is counted, but no balance loss or bias moves a choice they do not make.
HF_ROUTERS = (DeepseekV3TopkRouter, DeepseekV2TopkRouter, DeepseekV32TopkRouter, DeepseekV4TopKRouter,
              DeepseekV4HashRouter)
BIAS = "e_score_correction_bias"

# The balance losses, in the order balance_losses returns them; logged as aux_loss_<name>.
AUX_TERMS = ("seq", "device", "comm")


@dataclass(frozen=True)
class BalanceSettings:
    bias_update_speed: float   # gamma; 0: off
    seq_aux_alpha: float       # sequence-wise (V3) / expert-level (V2) balance loss factor; 0: off
    device_aux_alpha: float    # V2 device-level balance loss factor; 0: off
    comm_aux_alpha: float      # V2 communication balance loss factor; 0: off
    device_groups: int         # experts split into this many contiguous device groups (the model's n_group)
    device_limit: int          # M: the most device groups one token's experts may span (the model's topk_group)
    score_func: str            # "sigmoid" (V3), "softmax" (V2) or "sqrtsoftplus" (V4)
    num_experts: int
    top_k: int

    @property
    def has_aux(self) -> bool:
        return self.seq_aux_alpha > 0 or self.device_aux_alpha > 0 or self.comm_aux_alpha > 0

    @property
    def active(self) -> bool:
        return self.has_aux or self.bias_update_speed > 0


def resolve_settings(section, config) -> BalanceSettings | None:
    """Concrete settings from the run config's `moe` section (null: the family default); None for dense models."""
    # The published settings (each family's moe_defaults), used where the run config leaves a key null.
    family = family_of(config)
    defaults = family.moe_defaults
    if defaults is None:
        return None
    groups = int(getattr(config, "n_group", 1) or 1)
    values = {k: float(v if (v := getattr(section, k)) is not None else d) for k, d in defaults.items()}
    for key in ("device_aux_alpha", "comm_aux_alpha"):
        if getattr(section, key) is None and groups == 1:
            values[key] = 0.0  # one device group: the loss is a constant
    return BalanceSettings(**values, device_groups=groups, device_limit=int(getattr(config, "topk_group", 1) or groups),
                           score_func=family.score_func,
                           num_experts=int(config.n_routed_experts), top_k=int(config.num_experts_per_tok))


# The routers' affinity of an expert to a token, from its logit.
AFFINITY = {"sigmoid": torch.sigmoid, "softmax": lambda x: x.softmax(-1),
            "sqrtsoftplus": lambda x: torch.nn.functional.softplus(x).sqrt()}


def fixed_routing(router: nn.Module) -> bool:
    """A hash router (DeepSeek-V4's first layers): its experts come from a frozen token table."""
    return isinstance(router, DeepseekV4HashRouter)


# ----------------------------------------------------------------------------------------------- the losses
def balance_losses(logits: torch.Tensor, indices: torch.Tensor, s: BalanceSettings, shard=None) -> torch.Tensor:
    """Each sequence's balance losses, weighted by their alphas, in AUX_TERMS order: logits (B, T, E), indices
    (B, T, K) -> (B, 3). With f_i = E / (K T) * tokens of the sequence routed to expert i, P_i = mean over its tokens
    of the normalised affinity, D device groups E_d of experts and M = device_limit:
      seq     alpha1 * sum_i f_i P_i
      device  alpha2 * sum_d (mean_{i in E_d} f_i) (sum_{i in E_d} P_i)
      comm    alpha3 * sum_d f''_d (sum_{i in E_d} P_i),  f''_d = D / (M T) * tokens of the sequence sent to group d.
    shard: the tokens are one shard of each sequence (sequence parallelism, parallel.sequence.SequenceShard): the
    statistics are the whole sequence's, summed over the group, and the gradient reaches this shard's tokens."""
    b, t, e = logits.shape
    scores = AFFINITY[s.score_func](logits.float())
    if s.score_func != "softmax":
        scores = scores / scores.sum(-1, keepdim=True)  # V3's s'_{i,t}; softmax scores already sum to 1
    if shard is None:
        p = scores.mean(1)
    else:  # the sequence's tokens over its shards (the last shard of an MTP depth holds fewer)
        t = _whole_sequence_sum(torch.tensor(float(t), dtype=scores.dtype, device=scores.device), shard)
        p = _whole_sequence_sum(scores.sum(1), shard) / t
    counts = torch.zeros(b, e, dtype=p.dtype, device=p.device)
    counts.scatter_add_(1, indices.reshape(b, -1), torch.ones(b, indices[0].numel(), dtype=p.dtype, device=p.device))
    counts = _whole_sequence_sum(counts, shard)
    f = counts * (e / (s.top_k * t))
    out = torch.zeros(b, len(AUX_TERMS), dtype=p.dtype, device=p.device)
    out[:, 0] = s.seq_aux_alpha * (f * p).sum(-1)
    d = s.device_groups
    if s.device_aux_alpha > 0:
        out[:, 1] = s.device_aux_alpha * (f.view(b, d, -1).mean(-1) * p.view(b, d, -1).sum(-1)).sum(-1)
    if s.comm_aux_alpha > 0:
        p_group = p.view(b, d, -1).sum(-1)
        groups = indices.reshape(b, indices.shape[1], -1) // (e // d)
        # token -> group d
        sent = torch.zeros(b, indices.shape[1], d, dtype=p.dtype, device=p.device).scatter_(2, groups, 1.0)
        f_comm = _whole_sequence_sum(sent.sum(1), shard) * (d / (s.device_limit * t))
        out[:, 2] = s.comm_aux_alpha * (f_comm * p_group).sum(-1)
    return out


def _whole_sequence_sum(local: torch.Tensor, shard) -> torch.Tensor:
    """A per-sequence statistic summed over the sequence's shards; the gradient flows into this shard's own part
    (every rank of the group computes the whole sequence's loss and gives its tokens their share of its gradient)."""
    if shard is None:
        return local
    whole = local.detach().clone()
    dist.all_reduce(whole, group=shard.group)
    return local + (whole - local.detach())


# ----------------------------------------------------------------------------------------------- the hooks
def moe_blocks(model: nn.Module) -> dict[str, tuple[nn.Module, nn.Module]]:
    """name -> (MoE block, router) for transformers' blocks (router at .gate) and AutoEP's (router at .router).
    AutoEP replaces a block under the same name, so names identify a layer before and after replacement."""
    found = {}
    for name, m in model.named_modules():
        router = getattr(m, "gate", None)
        if not isinstance(router, HF_ROUTERS):
            router = getattr(m, "router", None)
            if not isinstance(router, TokenChoiceTopKRouter):
                continue
        found[name] = (m, router)
    return found


def router_bias(router: nn.Module) -> torch.Tensor | None:
    bias = getattr(router, BIAS, None)
    return bias if isinstance(bias, torch.Tensor) else None


def snapshot_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of every router bias, keyed by block name (taken before deepspeed.initialize)."""
    return {name: b.detach().float().clone() for name, (_, router) in moe_blocks(model).items()
            if (b := router_bias(router)) is not None}


def restore_fp32_biases(model: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    """The bias must stay fp32: steps of 1e-3 on values near 1 vanish in bf16. DeepSpeed casts buffers when
    `data_types.buffer_dtype` is set; put the exact fp32 values back (AutoEP may have moved them to a new module)."""
    for name, (_, router) in moe_blocks(model).items():
        bias = router_bias(router)
        if bias is not None and name in snapshot and bias.dtype != torch.float32:
            bias.data = snapshot[name].to(bias.device)


class ExpertLoad:
    """The one expert-load counter of a model: a forward hook on every router of `model` (this rank's layers)
    adds the tokens each routed expert receives in a training forward to `total` (MoE block x expert, in
    `moe_blocks` order). Evaluation forwards and activation checkpointing's recomputations do not count.
    keep_routing: also keep each router's latest (logits, chosen experts) for `routing()` (the balance losses).
    `total` only grows; each reader takes its own step's share through a `LoadReader`."""

    def __init__(self, model: nn.Module, num_experts: int, device, keep_routing: bool = False):
        self.num_experts = num_experts
        self.keep_routing = keep_routing
        self.blocks = moe_blocks(model)
        # float64 counts tokens exactly up to 2**53 per expert: far beyond any training run.
        self.total = torch.zeros(len(self.blocks), num_experts, dtype=torch.float64, device=device)
        self._routed: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        for row, (_, router) in enumerate(self.blocks.values()):
            router.register_forward_hook(partial(self._on_router, row))

    def _on_router(self, row: int, router: nn.Module, args, output) -> None:
        if not router.training:
            return
        if isinstance(router, HF_ROUTERS):
            logits, indices = output[0], output[2]
        else:  # AutoEP's router returns only the chosen scores: recompute the logits (one small matmul)
            logits, indices = (router.gate(args[0]) if self.keep_routing else None), output[1]
        if not in_backward():  # activation checkpointing's re-run forward: not new traffic
            self.total[row] += torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        if self.keep_routing and not fixed_routing(router):
            self._routed[row] = (logits, indices)

    def routing(self, row: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Router logits and chosen experts of block `row`'s current forward (each forward's once)."""
        return self._routed.pop(row)


class LoadReader:
    """One reader's view of an ExpertLoad: `take()` returns the tokens counted since this reader's previous
    take(), so the bias update and the per-step metrics each see the whole step without resetting the other's."""

    def __init__(self, load: ExpertLoad):
        self.load = load
        self._seen = load.total.clone()

    def peek(self) -> torch.Tensor:
        return self.load.total - self._seen

    def take(self) -> torch.Tensor:
        counts = self.peek()
        self._seen.copy_(self.load.total)
        return counts


class LoadBalancer:
    """Hooks on every MoE block of `model` (this rank's layers). Per training forward it counts the tokens per
    expert (its `load`) and adds the balance losses to backward; once per optimizer step the training loop reduces
    take_aux() and the load with its other metrics, then apply_load() moves the router biases and aux_metrics() gives
    the step's `aux_loss`.

    aux_grad_scale: the gradient that one sequence's balance loss gets, so that the optimizer sees the mean over
    the global batch's sequences: dp_size / global_batch_size (DeepSpeed averages gradients over data-parallel
    ranks; gradient accumulation divides only the LM loss, whose backward this gradient does not pass through).
    loss_scale: fp16's current dynamic loss scale (it multiplies the LM loss's gradients; it changes only at
    optimizer steps, so the value read in forward holds for that backward). sequence_shard: the blocks see one shard
    of each sequence (sequence parallelism); the balance losses are the whole sequences'.
    """

    def __init__(self, model: nn.Module, settings: BalanceSettings, aux_grad_scale: float, global_batch_size: int,
                 device, loss_scale: Callable[[], float] | None = None, sequence_shard=None):
        self.s = settings
        self.sequence_shard = sequence_shard
        self.aux_grad_scale = aux_grad_scale
        self.loss_scale = loss_scale
        self.global_batch_size = global_batch_size
        self.load = ExpertLoad(model, settings.num_experts, device, keep_routing=settings.has_aux)
        self._step_load = LoadReader(self.load)
        self.blocks = self.load.blocks
        self.routers = [router for _, router in self.blocks.values()]
        self.aux_sums = torch.zeros(len(AUX_TERMS), dtype=torch.float64, device=device)
        if settings.has_aux:
            for row, (block, router) in enumerate(self.blocks.values()):
                if not fixed_routing(router):
                    block.register_forward_hook(partial(self._on_block, row))

    @property
    def counts(self) -> torch.Tensor:
        """Tokens per expert (MoE block x expert) of the step so far."""
        return self._step_load.peek()

    def _on_block(self, row: int, block: nn.Module, args, output):
        if not block.training:
            return None
        logits, indices = self.load.routing(row)
        b, t = args[0].shape[:2]
        terms = balance_losses(logits.view(b, t, -1), indices.view(b, t, -1), self.s, self.sequence_shard).sum(0)
        if not in_backward():  # activation checkpointing's re-run forward: not new traffic
            self.aux_sums += terms.detach().double()
        scale = self.aux_grad_scale * (self.loss_scale() if self.loss_scale else 1.0)
        return AuxLossGrad.apply(output, terms.sum(), scale)

    def take_aux(self) -> torch.Tensor:
        """This rank's balance-loss sums of the step (AUX_TERMS; a device tensor), then zero for the next step:
        summed over every rank, aux_metrics() reads them."""
        total = self.aux_sums.clone()
        self.aux_sums.zero_()
        return total

    def aux_metrics(self, summed: list[float]) -> dict[str, float]:
        """aux_loss (the mean over the global batch's sequences) and each active term's, from take_aux() summed over
        every rank (every stage's layers, every replica's sequences) and read to the host."""
        means = [v / self.global_batch_size for v in summed]
        alphas = (self.s.seq_aux_alpha, self.s.device_aux_alpha, self.s.comm_aux_alpha)
        return {"aux_loss": sum(means),
                **{f"aux_loss_{name}": v for name, v, a in zip(AUX_TERMS, means, alphas) if a > 0}}

    def apply_load(self, load: torch.Tensor, skipped: bool) -> None:
        """The bias update from `load`, the step's tokens per expert summed over the data-parallel ranks (rows: this
        rank's blocks) by the caller with its other sums; on the device, no host read. Starts the next step."""
        self._step_load.take()
        self._update_bias(load, skipped)

    def _updates(self, skipped: bool) -> bool:
        return self.s.bias_update_speed > 0 and not skipped and bool(self.routers)

    def _update_bias(self, load: torch.Tensor, skipped: bool) -> None:
        if not self._updates(skipped):
            return
        with torch.no_grad():
            steps = torch.sign(load.mean(1, keepdim=True) - load) * self.s.bias_update_speed
            for row, router in enumerate(self.routers):
                bias = router_bias(router)
                if bias is not None:  # a hash router has none
                    bias.add_(steps[row].to(bias.dtype))


# ----------------------------------------------------------------------------------------------- expert parallelism
def autoep_preset(config) -> str:
    """The name of DeepSpeed AutoEP's preset for the model's MoE blocks."""
    return family_of(config).autoep_preset or config.model_type


def autoep_section(config, ep_size: int) -> dict:
    """DeepSpeed's `expert_parallel` (AutoEP) section. Our decoder layers sit at `layers.N.layer.mlp` (SequentialLM)
    or `N.layer.mlp` (a pipeline stage), not at the presets' `model.layers.N.mlp`: the pattern says so. AutoEP
    also reads the expert count, top-k, group routing and scaling from `model.config` (set by the caller)."""
    return {"enabled": True, "autoep_size": ep_size, "preset_model": autoep_preset(config),
            "moe_layer_pattern": r"(layers\.)?\d+\.layer\.mlp"}
