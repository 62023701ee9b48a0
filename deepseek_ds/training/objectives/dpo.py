"""train.objective dpo: the preference losses of pairs (models/preference_loss.py) against the reference
log-probabilities stored before training (objectives/dpo_reference.py), the pair metrics (preference_loss.METRICS)
named by the loss."""

from __future__ import annotations

import numpy as np
import torch

from ...data import micro_batch, open_dataset
from ...models.pipeline import split_micro_batch, to_device
from ...models.preference_loss import METRICS, chosen_nll, metric_sums, normalised, preference_terms, sequence_logps
from ..evaluation import eval_sample_count, task_scores_run
from ..run import Run
from .base import Objective
from .dpo_reference import adapters_off, buffer_copies, ensure_reference, lora_base_reference, reference_pass


class DPO(Objective):
    name = "dpo"
    sequences_per_sample = 2  # a pair: chosen and rejected

    def __init__(self):
        self.reference: np.ndarray | None = None  # the training split's reference log-probabilities
        self.valid_reference: np.ndarray | None = None  # with eval.interval: the validation split's
        self.base_buffers: list[torch.Tensor] | None = None  # a LoRA base as reference: its starting buffers

    def before_training(self, run: Run) -> None:
        # Before the resume: the engine still holds the starting weights.
        if run.loss_fn.needs_reference and lora_base_reference(run):
            # The base as it starts: training moves the router biases (buffers, not adapters), the reference keeps them.
            self.base_buffers = buffer_copies(run.engine.module)
        self.reference = ensure_reference(run, run.dataset)
        if run.cfg.eval.interval:
            self.valid_reference = ensure_reference(run, open_dataset(run.dataset_dir, run.cfg.data, "valid"), "valid")

    def batches(self, run: Run, sampler):
        return pair_batches(run, sampler, self.reference)

    def local_step(self, run: Run, micro_batches: list) -> torch.Tensor:
        return local_step(run, micro_batches, self.base_buffers)

    def metric_parts(self, run: Run, device: torch.device) -> dict[str, torch.Tensor]:
        return {"pairs": run.loss_fn.take_parts(device)}

    def metrics(self, run: Run, parts: dict[str, list[float]]) -> dict[str, float]:
        return {k: v for k, v in run.loss_fn.metrics(parts["pairs"]).items() if k != "loss"}

    def evaluate(self, run: Run, dataset) -> dict:
        return evaluate_run(run, dataset, self.valid_reference, self.base_buffers)

    def validation_message(self, step: int, record: dict) -> str:
        return (f"step {step}: validation loss {record['eval_loss']:.4f}, reward accuracy "
                f"{100 * record['eval_reward_accuracy']:.2f}%, margin {record['eval_reward_margin']:.4f}")

    def validation_lines(self, record: dict) -> list[str]:
        r = record
        return [f"  validation  pair loss {r['eval_loss']:.4f}, reward accuracy {100 * r['eval_reward_accuracy']:.1f}%"
                f", margin {r['eval_reward_margin']:.4f} (step {r['step']})"]


def _base_logps(run: Run, inputs, labels, base_buffers: list[torch.Tensor]) -> torch.Tensor:
    """The reference log-probabilities of a micro-batch's rows under the LoRA base (no gradient)."""
    with torch.no_grad(), adapters_off(run.engine.module, base_buffers):
        return sequence_logps(run.engine(to_device(inputs, run.engine.device)), labels)[0].double()


def pair_batches(run: Run, sampler, reference: np.ndarray | None):
    """Per global batch, this rank's micro-batches: ((input_ids, position_ids), labels, reference [2B] or None)."""
    for micro in sampler:
        out = []
        for idx in micro:
            inputs, labels = split_micro_batch(micro_batch(run.dataset, idx))
            ref = None if reference is None else torch.from_numpy(np.ascontiguousarray(reference[idx].T).reshape(-1))
            out.append((inputs, labels, ref))
        yield out


def local_step(run: Run, micro_batches: list, base_buffers: list[torch.Tensor] | None) -> torch.Tensor:
    """One optimizer step of pair losses: the sum of this rank's scaled micro losses (float64 device scalar);
    `base_buffers`: a LoRA base reference's starting buffers."""
    engine = run.engine
    run.loss_fn.set_scale(run.layout.gradient_size, run.grad_accum)
    if run.pipeline:  # (labels, reference) travel to the last stage; a reference-free loss gets zeros there
        split = [(inputs, (labels, torch.zeros(labels.shape[0], dtype=torch.float64) if ref is None else ref))
                 for inputs, labels, ref in micro_batches]
        return engine.train_batch(iter(split)).detach().double()
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    base = run.loss_fn.needs_reference and lora_base_reference(run)
    for inputs, labels, ref in micro_batches:
        labels = labels.to(engine.device)
        ref = _base_logps(run, inputs, labels, base_buffers) if base else None if ref is None else ref.to(engine.device)
        logits = engine(to_device(inputs, engine.device))
        loss = run.loss_fn(logits, (labels, ref))
        engine.backward(loss)
        engine.step()
        total += loss.detach().double()
    return total


def evaluate_run(run: Run, dataset, reference: np.ndarray | None, base_buffers: list[torch.Tensor] | None) -> dict:
    """The validation record at eval.interval: the METRICS as eval_* means over the split's first eval.batches global
    batches of pairs (eval_loss the pair loss), and eval.task's scores when the run has a task."""
    cfg, loss_fn = run.cfg, run.loss_fn
    n = eval_sample_count(len(dataset), cfg.eval.batches, cfg.train.global_batch_size)
    values = torch.from_numpy(reference_pass(run, dataset, count=n))
    if loss_fn.needs_reference and lora_base_reference(run):
        with adapters_off(run.engine.module, base_buffers):
            reference = reference_pass(run, dataset, count=n)[:, :2]
    counts, logps = values[:, 2:].t().reshape(-1), values[:, :2].t().reshape(-1)
    policy = normalised(logps, counts, loss_fn.loss)
    ref = None if reference is None else normalised(torch.from_numpy(reference[:n]).t().reshape(-1), counts,
                                                    loss_fn.loss)
    terms = preference_terms(policy, ref, loss_fn.loss, loss_fn.beta, loss_fn.label_smoothing, loss_fn.simpo_gamma,
                             loss_fn.rpo_alpha, chosen_nll(logps, counts))
    record = {f"eval_{k}": v / n for k, v in zip(METRICS, metric_sums(*terms).tolist())}
    record["eval_pairs"] = n
    if cfg.eval.task:
        record.update({f"task_{k}": v for k, v in task_scores_run(run).items()})
    return record
