"""train.objective lm: the next-token loss (models/loss.py), with its MTP depths' losses as named metrics."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...data import micro_batches
from ...models.loss import valid_token_counts
from ...models.pipeline import split_micro_batch, to_device
from ...parallel.sequence import shard_micro_batch
from ..evaluation import evaluate_run
from ..run import Run
from .base import Objective, task_scores_line


class NextToken(Objective):
    name = "lm"

    def batches(self, run: Run, sampler):
        return micro_batches(run.dataset, sampler)

    def local_step(self, run: Run, micro_batches: list) -> torch.Tensor:
        engine = run.engine
        # Sequence parallelism: each rank keeps its shard of every sequence (and the MTP depths' next tokens), and
        # counts and computes its own tokens.
        shard, depth = run.layout.sequence_shard, run.loss_fn.mtp_depth
        halo = depth if shard else 0
        micro_batches = [shard_micro_batch(mb, shard, halo) for mb in micro_batches]
        # Counted on the host (the batches are host tensors) without reading them; collectives take device tensors
        # (NCCL refuses host ones).
        n_valid = to_device(valid_token_counts(micro_batches, depth, halo).double(), engine.device)
        # The summed counts stay on the device: the loss scales need no host-device sync.
        layout = run.layout
        dist.all_reduce(n_valid, group=layout.gradient_group)
        run.loss_fn.set_global_tokens(n_valid, layout.gradient_size, run.grad_accum)
        if run.indexer:  # its loss counts the queries the LM loss counts
            run.indexer.set_global_tokens(n_valid[0], layout.gradient_size)
        # Micro-batches with position ids (packed sequences) give the model (input_ids, position_ids).
        split = [split_micro_batch(mb, mtp=run.loss_fn.mtp_depth > 0, query_mask=run.indexer is not None)
                 for mb in micro_batches]
        if run.pipeline:
            return engine.train_batch(iter(split)).detach().double()
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        for inputs, labels in split:
            logits = engine(to_device(inputs, engine.device))
            loss = run.loss_fn(logits, to_device(labels, engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        return total

    def metric_parts(self, run: Run, device: torch.device) -> dict[str, torch.Tensor]:
        # MTP parts [main, depth 1..D] (pipeline stages other than the last hold zeros)
        return {"mtp": run.loss_fn.take_parts(device)} if run.loss_fn.mtp_depth else {}

    def metrics(self, run: Run, parts: dict[str, list[float]]) -> dict[str, float]:
        gas_dp = run.layout.gradient_size * run.grad_accum
        return mtp_record([p / gas_dp for p in parts["mtp"]])

    def evaluate(self, run: Run, dataset) -> dict:
        return evaluate_run(run, dataset).as_record()

    def validation_message(self, step: int, record: dict) -> str:
        return (f"step {step}: validation loss {record['eval_loss']:.4f}, perplexity {record['eval_ppl']:.2f}, "
                f"next-token accuracy {100 * record['eval_accuracy']:.2f}%")

    def loss_lines(self, records: list[dict]) -> list[str]:
        first, last = records[0], records[-1]
        if "mtp_loss" in first:
            return [f"  of which    main {first['lm_loss']:.4f} -> {last['lm_loss']:.4f}, "
                    f"MTP {first['mtp_loss']:.4f} -> {last['mtp_loss']:.4f}"]
        if "indexer_loss" in first:  # DeepSeek-V3.2's trainable indexer (models/deepseek_v32/indexer_loss.py)
            return [f"  of which    LM {first['lm_loss']:.4f} -> {last['lm_loss']:.4f}, "
                    f"indexer KL {first['indexer_loss']:.4f} -> {last['indexer_loss']:.4f}"]
        return []

    def validation_lines(self, record: dict) -> list[str]:
        r = record
        task = [f"  eval.task   {task_scores_line(r)} (step {r['step']})"] if r.get("task_n") else []
        return [f"  validation  loss {r['eval_loss']:.4f}, perplexity {r['eval_ppl']:.2f}, "
                f"next-token accuracy {100 * r['eval_accuracy']:.2f}% (step {r['step']})"] + task


def mtp_record(parts: list[float]) -> dict[str, float]:
    """The main LM loss and each MTP depth's loss of the step from their global-batch means [main, depth 1..D].
    `loss` is what was optimised, lm_loss + mtp_loss_weight x mtp_loss."""
    record = {"lm_loss": parts[0], "mtp_loss": sum(parts[1:]) / len(parts[1:])}
    if len(parts) > 2:
        record.update({f"mtp_loss_{k}": v for k, v in enumerate(parts[1:], start=1)})
    return record
