"""GRPO's loss on completions (DeepSeekMath sec. 4.1, DeepSeek-R1), as TRL's GRPOTrainer computes it (its
`_compute_loss`), for the three aggregations TRL names grpo, dapo and dr_grpo.

Per completion token t of completion i with advantage A_i, log-probabilities log p (the policy's, at the sampling
temperature), log p_old (the policy when it generated; log p detached with one update per generation) and log p_ref:
    ratio = exp(log p - log p_old)  (importance_sampling_level token; sequence: exp of the completion's mean, GSPO)
    loss_t = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta k3_t,
    k3_t = exp(log p_ref - log p) - (log p_ref - log p) - 1.
Aggregated over the global batch: grpo, the mean over completions of each one's token mean; dapo, the mean over all
completion tokens; dr_grpo, the sum over tokens / (completions x max_completion_length). TRL computes these per
micro-batch and divides by the accumulation steps; with equal micro-batches that is the global figure, which the
weights here give whatever the layout (DeepSpeed divides by the accumulation steps and averages over data-parallel
ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .loss import Projection

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
# Summed over the global batch's completion tokens (or completions) into the step's metrics, in this order.
METRICS = ("kl", "clip_ratio", "entropy", "completion_length")


def completion_logps(logits, completion: torch.Tensor, starts: torch.Tensor, temperature: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities of the completion tokens, fp32 [B, T]; the policy's entropy at each of them, detached
    [B, T]) from the model's output over rows [prompt | completion | padding] whose completion i starts at column
    starts[i] (logits at column c predict token c + 1), at the sampling temperature (TRL divides the logits by it).
    `logits`: [B, S, V] or the head's Projection, projected one row's completion at a time."""
    width = completion.shape[1]
    logps, entropies = [], []
    for r, start in enumerate(starts.tolist()):
        columns = slice(start - 1, start - 1 + width)
        if isinstance(logits, Projection):
            row = F.linear(logits.hidden[0][r, columns], logits.weight)
        else:
            row = (logits[0] if isinstance(logits, tuple) else logits)[r, columns]
        log_probs = torch.log_softmax(row.float() / temperature, dim=-1)
        logps.append(log_probs.gather(-1, completion[r].unsqueeze(-1)).squeeze(-1))
        entropies.append(-(log_probs.exp() * log_probs).sum(-1).detach())
    return torch.stack(logps), torch.stack(entropies)


@dataclass(frozen=True)
class GRPOSettings:
    beta: float
    epsilon: float
    epsilon_high: float
    loss_type: str
    importance_sampling_level: str
    max_completion_length: int


def token_losses(s: GRPOSettings, logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss [B, T], per-token k3 KL [B, T] (zeros without a reference), the clipped tokens [B, T] bool)."""
    log_ratio = logps - old_logps
    if s.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.epsilon_high)
    a = advantages.unsqueeze(1)
    loss = -torch.min(ratio * a, clipped * a)
    kl = torch.zeros_like(logps)
    if s.beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        loss = loss + s.beta * kl
    was_clipped = ((ratio < 1 - s.epsilon) & (a < 0)) | ((ratio > 1 + s.epsilon_high) & (a > 0))
    return loss.expand_as(logps), kl, was_clipped.expand_as(logps)


def token_weights(s: GRPOSettings, mask: torch.Tensor, completions: torch.Tensor, tokens: torch.Tensor,
                  ranks_x_accumulation: int) -> torch.Tensor:
    """Each completion token's weight in a micro-batch's loss [B, T]: summed over every rank's micro-batches,
    divided by the accumulation steps and averaged over the data-parallel ranks (DeepSpeed), it gives the global
    aggregation of `loss_type`. completions / tokens: the global batch's (device scalars, never read)."""
    mask = mask.float()
    if s.loss_type == "grpo":
        per_token = mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / completions
    elif s.loss_type == "dapo":
        per_token = mask / tokens.clamp(min=1.0)
    else:  # dr_grpo
        per_token = mask / (completions * s.max_completion_length)
    return per_token * ranks_x_accumulation


def group_advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], each completion's group std [N]) of rewards [N] in consecutive groups of `group` completions
    of one prompt: r minus its group's mean, divided by (std + 1e-4) of its group (`scale` group), of the whole batch
    (batch: `batch_std`, the global batch's std) or by nothing (none); std as torch.std (unbiased), as TRL."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(1).repeat_interleave(group)
    std = grouped.std(1).repeat_interleave(group)
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (std + 1e-4)
    elif scale == "batch":
        advantages = advantages / (batch_std + 1e-4)
    return advantages, std


class GRPOLoss:
    """train.objective grpo's loss of a micro-batch of completions and the step's metric sums (what PreferenceLoss is
    to dpo): the rewards (summed by the objective with add_rewards), the KL, clipped share, entropy and lengths."""

    def __init__(self, settings: GRPOSettings, temperature: float, reward_names: list[str]):
        self.s, self.temperature, self.reward_names = settings, temperature, list(reward_names)
        self._parts: torch.Tensor | None = None
        self.replay = None  # grpo.router_replay: the training forward's router_replay.RouterReplay

    def __call__(self, output, completion: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor,
                 advantages: torch.Tensor, ref_logps: torch.Tensor | None, completions: torch.Tensor,
                 tokens: torch.Tensor, ranks_x_accumulation: int, old_logps: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The micro-batch's scaled loss: rows [prompt | completion | padding], completion i from column starts[i].
        old_logps: the sampling policy's log-probabilities (num_iterations > 1); None: the policy that sampled is this
        one, one update per generation (TRL: old = current, detached)."""
        logps, entropy = completion_logps(output, completion, starts, self.temperature)
        old = logps.detach() if old_logps is None else old_logps
        loss, kl, clipped = token_losses(self.s, logps, old, ref_logps, advantages, mask)
        weights = token_weights(self.s, mask, completions, tokens, ranks_x_accumulation)
        m = mask.float()
        self._add(torch.stack([(kl.detach() * m).sum(), (clipped * m).sum(), (entropy * m).sum(), m.sum(),
                               torch.tensor(float(mask.shape[0]), device=m.device)]).double())
        return (loss * weights).sum()

    def logps(self, output, completion: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """The completion tokens' log-probabilities (a reference model's output)."""
        return completion_logps(output, completion, starts, self.temperature)[0]

    def add_rewards(self, rewards: torch.Tensor, per_function: torch.Tensor) -> None:
        """This rank's completions' rewards [n] and each function's [F, n] into the step's sums."""
        self._add(torch.cat([torch.zeros(5, dtype=torch.float64, device=rewards.device),
                             torch.stack([rewards.sum(), (rewards ** 2).sum()]).double(),
                             per_function.double().sum(1)]))

    def _add(self, values: torch.Tensor) -> None:
        if values.numel() < 7 + len(self.reward_names):
            values = torch.cat([values, values.new_zeros(7 + len(self.reward_names) - values.numel())])
        self._parts = values if self._parts is None else self._parts + values

    def take_parts(self, device) -> torch.Tensor:
        """[kl, clipped, entropy (token sums), tokens, completions, reward sum, reward square sum, each function's
        sum] of this rank's step, then zero."""
        parts = torch.zeros(7 + len(self.reward_names), dtype=torch.float64, device=device)
        if self._parts is not None:
            parts += self._parts.to(device)
        self._parts = None
        return parts

    def metrics(self, parts: list[float], replay: list[float] | None = None) -> dict[str, float]:
        """The step's metrics from take_parts summed over the ranks: token means of kl, clip_ratio and entropy; the
        mean completion_length; reward (mean), reward_std (over the global batch, unbiased) and reward/<function>;
        with router replay's (changed, replayed) routing decisions, the share it changed."""
        kl, clipped, entropy, tokens, completions, total, squares, *functions = parts
        changed = {} if replay is None else {"router_replay_changed": replay[0] / max(replay[1], 1.0)}
        n = max(completions, 1.0)
        variance = (squares - total * total / n) / max(n - 1, 1.0)
        return {**changed, "reward": total / n, "reward_std": max(variance, 0.0) ** 0.5,
                **{f"reward/{name}": v / n for name, v in zip(self.reward_names, functions)},
                "kl": kl / max(tokens, 1.0), "clip_ratio": clipped / max(tokens, 1.0),
                "entropy": entropy / max(tokens, 1.0), "completion_length": tokens / n}
