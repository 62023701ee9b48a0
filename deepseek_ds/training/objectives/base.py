"""What a training objective is to the loop (training/loop.py): the data it steps on, one optimizer step's loss, its
named metrics, its validation and its lines of the run's summary. One class per train.objective
(objectives/__init__.py), one object per run (Run.objective): the loop never branches on the objective. What an
objective keeps across steps (e.g. DPO's reference log-probabilities) is the object's own; the Run never changes."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...data import GlobalBatchSampler
from ..run import Run


class Objective:
    """The interface, with the defaults of an objective that needs nothing before training and has no metrics of its
    own besides the loss."""
    name: str
    sequences_per_sample = 1  # sequences of data.seq_len tokens in a sample (tokens and FLOPs per step)

    def before_training(self, run: Run) -> None:
        """Work before the resume, while the engine still holds the starting weights (e.g. the reference's values, kept
        on the object); every rank calls it."""

    def sampler(self, run: Run, consumed_samples: int = 0) -> GlobalBatchSampler:
        """The run's global batches after `consumed_samples` (this rank's share), in samples of the dataset."""
        return run.sampler(consumed_samples)

    def batches(self, run: Run, sampler: GlobalBatchSampler) -> Iterator[list]:
        """Per global batch of `sampler`, this rank's micro-batches as local_step takes them."""
        raise NotImplementedError

    def stops_at(self, run: Run, step: int) -> bool:
        """Whether a checkpoint of `step` resumes exactly: a stop on a signal waits for the next such step."""
        return True

    def local_step(self, run: Run, micro_batches: list) -> torch.Tensor:
        """One optimizer step on this rank's share of the global batch, nothing read to the host: the sum of this
        rank's scaled micro losses (a float64 device scalar, to be summed over the data-parallel ranks into
        gradient ranks x gas x the global-batch loss), or with a pipeline the global-batch loss DeepSpeed reduced."""
        raise NotImplementedError

    def metric_parts(self, run: Run, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's float64 sums of the step behind the objective's metrics, by name, summed over the ranks with
        the loss (empty: no metrics of its own). The loop counts them once per replica."""
        return {}

    def metrics(self, run: Run, parts: dict[str, list[float]]) -> dict[str, float]:
        """The step's named metrics of metrics.jsonl from metric_parts summed over the ranks, by the same names."""
        return {}

    def evaluate(self, run: Run, dataset) -> dict:
        """The validation record (eval_* metrics) on `dataset`, the validation split; every rank calls it."""
        raise NotImplementedError

    def validation_message(self, step: int, record: dict) -> str:
        """The log line of a validation record."""
        raise NotImplementedError

    def loss_lines(self, records: list[dict]) -> list[str]:
        """The run summary's lines after its loss (e.g. the loss's parts)."""
        return []

    def validation_lines(self, record: dict) -> list[str]:
        """The run summary's lines of its last validation record."""
        raise NotImplementedError


def task_scores_line(record: dict) -> str:
    """eval.task's scores of a validation record."""
    return (f"task exact match {100 * record['task_exact_match']:.1f}%, BLEU {record['task_bleu']:.2f} "
            f"({record['task_n']} items)")
