"""Validation loss, perplexity and next-token accuracy, on any number of data-parallel ranks: the periodic
evaluation of a training run, and the building blocks of `deepseek-ds eval` (inference/eval.py).

The evaluation set is the first `eval.batches x train.global_batch_size` samples of the validation split
(capped at its size), a choice that does not depend on the parallel layout. Data-parallel ranks take
contiguous shares of it; every rank runs the same number of micro-batches (short ones are padded with
ignored labels), because ZeRO-3 and pipeline forwards are collectives. Each rank sums token losses, valid
tokens and correct predictions; one all_reduce of the three sums gives exactly the token-weighted result of
a single process.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import PackedDataset
from ..models.loss import IGNORE_INDEX
from ..models.pipeline import split_micro_batch, to_device
from .setup import Run


@dataclass(frozen=True)
class EvalResult:
    loss: float        # mean cross-entropy per valid token (nats)
    perplexity: float
    accuracy: float    # fraction of valid tokens whose argmax prediction is the label
    tokens: int

    def as_record(self) -> dict:
        return {"eval_loss": self.loss, "eval_ppl": self.perplexity, "eval_accuracy": self.accuracy,
                "eval_tokens": self.tokens}


class TokenSums:
    """A loss function that also keeps [summed CE, valid tokens, correct predictions] over its calls. It stands
    in for the training loss during evaluation, including inside DeepSpeed's pipeline (last stage)."""

    def __init__(self):
        self._sums: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat, labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
        ce = F.cross_entropy(flat, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        valid = labels != IGNORE_INDEX
        correct = (flat.argmax(-1) == labels) & valid
        step = torch.stack([ce.double(), valid.sum().double(), correct.sum().double()])
        self._sums = step if self._sums is None else self._sums + step
        return ce

    def sums(self, device) -> torch.Tensor:
        """The three sums on `device` (zeros where this rank computed no loss: earlier pipeline stages)."""
        return torch.zeros(3, dtype=torch.float64, device=device) if self._sums is None else self._sums.to(device)


def eval_sample_count(available: int, batches: int, global_batch_size: int) -> int:
    return min(available, batches * global_batch_size)


def rank_batches(dataset, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[tuple]:
    """This rank's (input_ids, labels) micro-batches of the first `num_samples` samples; the same number of
    full-size micro-batches on every rank, padded with IGNORE_INDEX labels."""
    per_rank = math.ceil(num_samples / dp_size)
    mine = list(range(dp_rank * per_rank, min((dp_rank + 1) * per_rank, num_samples)))
    out = []
    for j in range(math.ceil(per_rank / micro_batch_size)):
        idx = mine[j * micro_batch_size:(j + 1) * micro_batch_size]
        inputs = torch.zeros(micro_batch_size, dataset.seq_len, dtype=torch.long)
        labels = torch.full((micro_batch_size, dataset.seq_len), IGNORE_INDEX, dtype=torch.long)
        if idx:
            rows = torch.from_numpy(np.stack([dataset[i] for i in idx]).astype(np.int64))
            inputs[:len(idx)], labels[:len(idx)] = rows[:, :-1], rows[:, 1:]
        out.append((inputs, labels))
    return out


@contextmanager
def _pipeline_eval_loss(engine, sums: TokenSums):
    """Let DeepSpeed's pipeline evaluate with `sums` as its loss, and keep it from logging its own eval loss
    (a mean of micro-batch means, not token-weighted) next to ours."""
    loss_fn, monitoring = engine.module.loss_fn, engine.monitor.enabled
    engine.module.loss_fn, engine.monitor.enabled = sums, False
    try:
        yield
    finally:
        engine.module.loss_fn, engine.monitor.enabled = loss_fn, monitoring


def evaluate(model, batches: list[tuple], device, pipeline: bool = False) -> EvalResult:
    """Evaluate `model` (a module, a DeepSpeed engine, or a PipelineEngine with pipeline=True) on this rank's
    batches and combine all ranks. Every rank must call it, with the same number of batches."""
    sums = TokenSums()
    batches = [split_micro_batch(mb) for mb in batches]  # packed sequences: the model takes their position ids
    if pipeline:
        with _pipeline_eval_loss(model, sums):
            model.eval_batch(iter(batches), compute_loss=True, bcast_loss=False, num_micro_batches=len(batches))
    else:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for inputs, labels in batches:
                sums(model(to_device(inputs, device)), labels.to(device))
        model.train(was_training)
    total = sums.sums(device)
    if dist.is_initialized():
        dist.all_reduce(total)  # pipeline: only last stages hold sums, one per replica
    ce, tokens, correct = total.tolist()
    loss = ce / tokens
    return EvalResult(loss, math.exp(loss), correct / tokens, int(tokens))


def evaluate_run(run: Run, dataset: PackedDataset) -> EvalResult:
    """The periodic evaluation of a training run on its validation split."""
    cfg = run.cfg
    n = eval_sample_count(len(dataset), cfg.eval.batches, cfg.train.global_batch_size)
    batches = rank_batches(dataset, n, cfg.train.micro_batch_size, run.dp_rank, run.dp_size)
    return evaluate(run.engine, batches, run.engine.device, pipeline=run.pipeline)
