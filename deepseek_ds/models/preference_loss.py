"""Preference losses on sequence log-probabilities: DPO (sigmoid), IPO and SimPO, as TRL defines them.

A micro-batch of B pairs is 2B rows, the B chosen sequences then the B rejected ones (data/sampler.micro_batch). A
sequence's log-probability is the sum of its per-token log-probabilities over its trained labels (the response and
its EOS), and for IPO and SimPO that sum divided by their count (the length-normalised, per-token mean). With
policy logps pc, pr and reference logps rc, rr of a pair (TRL DPOTrainer / CPOTrainer):
    sigmoid (DPO):  z = (pc - pr) - (rc - rr),  loss = -logsigmoid(beta z)(1 - ls) - logsigmoid(-beta z) ls
    ipo:            z as above on per-token means, loss = (z - 1 / (2 beta))^2
    simpo:          z = (pc - pr) - gamma / beta on per-token means, no reference; loss as sigmoid's
With rpo_alpha > 0 each pair's loss also gets rpo_alpha x the chosen response's per-token mean negative
log-likelihood (RPO: Pang et al. 2024, "Iterative Reasoning Preference Optimization"; TRL's loss_type
["sigmoid", "sft"] takes the token mean over each micro-batch instead, which depends on how pairs are batched).
rewards_chosen = beta (pc - rc) (SimPO: beta pc), rewards_rejected likewise; reward_margin = chosen - rejected;
reward_accuracy = the share of pairs whose chosen reward is the larger one. Each is a mean over the global batch's
pairs, and so is the loss whose gradients the step takes (as TRL's per-batch mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .loss import IGNORE_INDEX, Projection

SIGMOID, IPO, SIMPO = "sigmoid", "ipo", "simpo"
LOSSES = (SIGMOID, IPO, SIMPO)
# Summed per pair into the step's metrics, in this order; divided by the global batch's pairs they are its means.
METRICS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


def sequence_logps(logits, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's labels, fp32 [R]; trained labels per row [R]). `logits`: [R, S, V]
    logits or the head's Projection, projected one row at a time (one row's fp32 logits at once)."""
    rows = []
    for r in range(labels.shape[0]):
        if isinstance(logits, Projection):
            row = F.linear(logits.hidden[0][r], logits.weight).float()
        else:
            row = (logits[0] if isinstance(logits, tuple) else logits)[r].float()
        rows.append(-F.cross_entropy(row, labels[r], ignore_index=IGNORE_INDEX, reduction="sum"))
    return torch.stack(rows), (labels != IGNORE_INDEX).sum(1)


def normalised(logps: torch.Tensor, counts: torch.Tensor, loss: str) -> torch.Tensor:
    """The sequence log-probabilities the loss compares: sums (sigmoid), per-token means (ipo, simpo)."""
    return logps / counts.clamp(min=1) if loss in (IPO, SIMPO) else logps


def chosen_nll(logps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[B] the chosen responses' per-token mean negative log-likelihood, from [2B] summed logps and label counts."""
    return -(logps.chunk(2)[0] / counts.chunk(2)[0].clamp(min=1))


def preference_terms(policy: torch.Tensor, reference: torch.Tensor | None, loss: str, beta: float,
                     label_smoothing: float = 0.0, simpo_gamma: float = 0.0, rpo_alpha: float = 0.0,
                     nll: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(per-pair losses, chosen rewards, rejected rewards) from the [2B] log-probabilities of B pairs (chosen rows
    first), already `normalised`; `reference` is unused (may be None) for SimPO; `nll` (chosen_nll) is needed when
    rpo_alpha > 0."""
    if loss not in LOSSES:
        raise ValueError(f"preference loss {loss!r}: use one of {', '.join(LOSSES)}")
    pc, pr = policy.chunk(2)
    if loss == SIMPO:
        z = (pc - pr) - simpo_gamma / beta
        chosen, rejected = beta * pc, beta * pr
    else:
        rc, rr = reference.to(policy.dtype).chunk(2)
        z = (pc - pr) - (rc - rr)
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    if loss == IPO:
        losses = (z - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * z) * (1 - label_smoothing) - F.logsigmoid(-beta * z) * label_smoothing
    if rpo_alpha:
        losses = losses + rpo_alpha * nll.to(losses.dtype)
    return losses, chosen.detach(), rejected.detach()


def metric_sums(losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """METRICS summed over the given pairs (float64)."""
    return torch.stack([losses.detach().sum(), chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                        (chosen > rejected).sum()]).double()


class PreferenceLoss:
    """The training loss of train.objective dpo: called with (logits, (labels, reference logps)) per micro-batch,
    it returns the micro-batch's summed pair losses x dp x gas / global pairs, which DeepSpeed's averaging over
    gradient-accumulation steps and data-parallel ranks turns into the mean over the global batch's pairs."""
    __name__ = "PreferenceLoss"
    mtp_depth = 0

    def __init__(self, loss: str, beta: float, label_smoothing: float, simpo_gamma: float, pairs_per_step: int,
                 rpo_alpha: float = 0.0):
        self.loss, self.beta, self.label_smoothing, self.simpo_gamma = loss, beta, label_smoothing, simpo_gamma
        self.rpo_alpha = rpo_alpha
        self.pairs_per_step = pairs_per_step
        self.scale = None
        self._sums = None  # METRICS summed over this rank's micro-batches since take_parts

    @property
    def needs_reference(self) -> bool:
        return self.loss != SIMPO

    def set_scale(self, dp_size: int, grad_accum: int) -> None:
        self.scale = dp_size * grad_accum / self.pairs_per_step

    def __call__(self, logits, labels) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("PreferenceLoss.set_scale must be called before training")
        labels, reference = labels
        logps, counts = sequence_logps(logits, labels)
        ref = normalised(reference, counts, self.loss) if self.needs_reference else None
        losses, chosen, rejected = preference_terms(normalised(logps, counts, self.loss), ref, self.loss, self.beta,
                                                    self.label_smoothing, self.simpo_gamma, self.rpo_alpha,
                                                    chosen_nll(logps, counts))
        sums = metric_sums(losses, chosen, rejected)
        self._sums = sums if self._sums is None else self._sums + sums
        return losses.sum() * self.scale

    def take_parts(self, device) -> torch.Tensor:
        """METRICS summed over this rank's pairs since the last call (zeros where this rank computed no loss)."""
        parts = torch.zeros(len(METRICS), dtype=torch.float64, device=device)
        if self._sums is not None:
            parts += self._sums.to(device)
        self._sums = None
        return parts

    def metrics(self, summed: list[float]) -> dict[str, float]:
        """The step's record from take_parts summed over the data-parallel replicas."""
        return {name: value / self.pairs_per_step for name, value in zip(METRICS, summed)}
