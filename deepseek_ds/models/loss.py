"""Causal LM loss, token-weighted over the whole global batch, with DeepSeek-V3's multi-token-prediction loss.

DeepSpeed divides each micro-batch loss by the gradient-accumulation steps and averages gradients over
data-parallel ranks. Scaling each micro-batch's summed token loss by dp * gas / (valid tokens in the global
batch) turns that into exactly the mean over every valid token of the global batch, which is what
transformers computes for the same batch in one piece, even when micro-batches hold different numbers of
valid (non -100) tokens.

With D MTP modules the model returns (main logits, depth-1 logits, ..., depth-D logits); depth k covers the
first T-k positions and at position i predicts token i+k+1, i.e. its targets are labels[:, k:]. Each depth's loss is its own token mean over the global
batch and the total is L_main + weight / D * sum_k L_k (DeepSeek-V3 tech report eq. 24-25). In packed sequences
(labels come with position_ids) a depth-k target that lies in a later document than its position is not one:
it is ignored, so each document's MTP loss is the one it has alone.

In training the head hands the loss a `Projection` (final hidden states and the head's weight) instead of logits,
and the loss projects a chunk of tokens at a time (`linear_cross_entropy`): batch x seq x vocab fp32 logits (2 GB
per 4k-token sequence of DeepSeek's 129,280-token vocabulary) never exist at once, in the forward or the backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# The largest fp32 logits block the loss holds at once, in elements: 128 MiB, ~260 tokens of a 129,280-token
# vocabulary. A micro-batch under it (the tiny presets' whole micro-batch) takes the plain one-piece loss.
CHUNK_LOGITS = 2**25


class Projection(NamedTuple):
    """The head's output in training: the final hidden states (main model, then MTP depths 1..D) and the head's
    weight, projected to logits by the loss one chunk of tokens at a time. A tuple, so DeepSpeed's output hooks
    (backward prologue) find the hidden states as they find logits."""
    hidden: tuple[torch.Tensor, ...]
    weight: torch.Tensor


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """sum over tokens of cross_entropy(linear(hidden, weight).float(), targets), -100 ignored: the plain loss's
    numbers (the matmul in the model's dtype, softmax in fp32), computed `chunk_tokens` tokens at a time
    (default: CHUNK_LOGITS / vocab) and recomputed chunk by chunk in the backward."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    chunk = chunk_tokens or max(1, CHUNK_LOGITS // weight.shape[0])
    if hidden.shape[0] <= chunk:
        return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Saves only its inputs (hidden states, weight, targets); the backward recomputes each chunk's logits and turns
    them into d(sum CE)/d(logits) = softmax - one_hot(target) (zero on ignored tokens) in place."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start:start + chunk], weight).float()
            total += F.cross_entropy(logits, targets[start:start + chunk], ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Summed over chunks in fp32 and cast once at the end (each chunk's product is in the input dtype, as the
        # one-piece matmul's would be; its sum over chunks is not rounded to it again).
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[start:start + ctx.chunk], targets[start:start + ctx.chunk]
            grad = torch.softmax(F.linear(h, weight).float(), dim=-1)
            valid = t != IGNORE_INDEX
            # Index arithmetic rather than nonzero(): no host-device sync per chunk.
            grad[torch.arange(len(t), device=t.device), t.clamp(min=0)] -= 1.0
            grad *= (valid * grad_total).unsqueeze(1)
            grad = grad.to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:start + ctx.chunk] = grad @ weight
            if need_weight:
                grad_weight += (grad.t() @ h).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def shift_labels(labels: torch.Tensor, k: int, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Targets of MTP depth k (k = 0: the main model's). With position_ids (documents start where they are 0),
    position i's target labels[i + k] is ignored when a document starts in (i, i + k]."""
    targets = labels[:, k:]
    if position_ids is None or k == 0:
        return targets
    starts = (position_ids == 0).cumsum(1)
    crosses = starts[:, k:] != starts[:, :starts.shape[1] - k]
    return targets.masked_fill(crosses, IGNORE_INDEX)


class TokenWeightedLoss:
    __name__ = "TokenWeightedLoss"

    def __init__(self, mtp_depth: int = 0, mtp_weight: float = 0.0):
        self.mtp_depth = mtp_depth
        self.mtp_weight = mtp_weight
        self.scales = None  # per depth (0: main), set per global batch by the training loop (set_global_tokens)
        self._parts = None  # detached scaled losses per depth, summed over this rank's micro-batches
        self._row_groups: list[torch.Tensor] = []  # per coming micro-batch, each row's group (a blend's source)
        self._group_sums = None  # [group, (summed main CE, valid targets)] of this rank's micro-batches, detached
        self._num_groups = 0

    def set_global_tokens(self, global_valid_tokens, dp_size: int, grad_accum: int) -> None:
        """global_valid_tokens: valid targets of the global batch, an int, one per depth (valid_token_counts), or a
        tensor of those, which stays where it is (the training loop's all-reduced counts: no host-device sync)."""
        counts = torch.as_tensor(global_valid_tokens, dtype=torch.float64).reshape(-1)
        if counts.numel() != 1 + self.mtp_depth:
            raise ValueError(f"expected valid-token counts for the main loss and {self.mtp_depth} MTP depths, got "
                             f"{global_valid_tokens}")
        # fp32, the dtype of each summed loss it scales (as a Python float scale would be applied).
        self.scales = (dp_size * grad_accum / counts.clamp(min=1)).float()

    def __call__(self, logits, labels) -> torch.Tensor:
        """logits: a tensor, the tuple of (main, MTP depth 1..D) logits, or the head's Projection of them.
        labels: a tensor, or (labels, position_ids) for packed sequences (models.pipeline.split_micro_batch)."""
        if self.scales is None:
            raise RuntimeError("TokenWeightedLoss.set_global_tokens must be called before each global batch")
        labels, position_ids = labels if isinstance(labels, tuple) else (labels, None)
        # A sequence shard's labels go on past its positions (the MTP halo): each output's own positions' targets.
        if isinstance(logits, Projection):
            outputs = logits.hidden

            def summed(k, rows=slice(None)):
                h = outputs[k][rows]
                return linear_cross_entropy(h, logits.weight, shift_labels(labels, k, position_ids)[rows, :h.shape[1]])
        else:
            outputs = logits if isinstance(logits, tuple) else (logits,)

            def summed(k, rows=slice(None)):
                out = outputs[k][rows]
                return F.cross_entropy(out.float().reshape(-1, out.shape[-1]),
                                       shift_labels(labels, k, position_ids)[rows, :out.shape[1]].reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
        sums = [summed(k) for k in range(1, len(outputs))]
        sums.insert(0, self._grouped_main_sum(summed, labels, position_ids, outputs[0].shape[1]) if self._row_groups
                    else summed(0))
        parts = torch.stack([s * self.scales[k] for k, s in enumerate(sums)])
        detached = parts.detach().double()
        self._parts = detached if self._parts is None else self._parts + detached
        if len(outputs) == 1:
            return parts[0]
        return parts[0] + self.mtp_weight / (len(outputs) - 1) * parts[1:].sum()

    def queue_row_groups(self, groups: list[torch.Tensor], num_groups: int) -> None:
        """Each row's group (int64, [rows]) of the micro-batches this rank's next calls get, in order: their main
        loss is then summed group by group (the same total) and each group's sum and targets kept (take_group_sums).
        Without a pipeline every micro-batch comes to this rank's loss; with one, to the last stage's only."""
        self._row_groups, self._num_groups = list(groups), num_groups

    def _grouped_main_sum(self, summed, labels, position_ids, positions: int) -> torch.Tensor:
        groups = self._row_groups.pop(0)
        targets = shift_labels(labels, 0, position_ids)[:, :positions] != IGNORE_INDEX
        if self._group_sums is None:  # on the loss's device: no host-device sync
            self._group_sums = torch.zeros(self._num_groups, 2, dtype=torch.float64, device=labels.device)
        total = 0.0
        for g in groups.unique().tolist():  # host tensors
            rows = (groups == g).nonzero().flatten().to(labels.device)
            part = summed(0, rows)
            self._group_sums[g] += torch.stack([part.detach().double(), targets[rows].sum().double()])
            total = total + part
        return total

    def take_group_sums(self, device) -> torch.Tensor | None:
        """[group, (summed main CE, valid targets)] since the last call (zeros on ranks that computed no loss);
        None when no groups were queued."""
        if not self._num_groups:
            return None
        sums, self._group_sums = self._group_sums, None
        return sums.to(device) if sums is not None else torch.zeros(self._num_groups, 2, dtype=torch.float64,
                                                                    device=device)

    def take_parts(self, device) -> torch.Tensor:
        """[main, depth 1..D] losses of this rank's micro-batches since the last call, each scaled as in training
        (summed over every rank and divided by dp x gas they are the global-batch means); zeros where this rank
        computed no loss (earlier pipeline stages)."""
        parts = torch.zeros(1 + self.mtp_depth, dtype=torch.float64, device=device)
        if self._parts is not None:
            parts += self._parts.to(device)
        self._parts = None
        return parts


def valid_token_counts(micro_batches, depth: int = 0, halo: int = 0) -> torch.Tensor:
    """Valid targets of the main loss and of each MTP depth 1..depth over the given micro-batches
    ((input_ids, labels[, position_ids]) each): an int64 tensor on their device, read by nothing (the training loop
    all-reduces it on the device: no host-device sync). halo: the micro-batches are sequence shards with the next
    `halo` tokens (parallel.sequence.shard_micro_batch), which are not their positions."""
    def valid(mb, k):
        targets = shift_labels(mb[1], k, mb[2] if len(mb) == 3 else None)
        return (targets[:, :mb[1].shape[1] - halo] != IGNORE_INDEX).sum()
    return torch.stack([sum(valid(mb, k) for mb in micro_batches) for k in range(depth + 1)])
