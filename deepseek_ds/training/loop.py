"""The training loop: one global batch per optimizer step, identical for every parallel layout."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import checkpoint
from ..models.loss import count_valid_tokens
from .metrics import MetricsWriter, flops_per_token, plot_loss
from .setup import Run


def _all_reduce(value: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(value, op=op, group=group)
    return value


def train_step(run: Run, micro_batches: list) -> float:
    """One optimizer step on this rank's share of the global batch; returns the global-batch loss."""
    engine = run.engine
    n_valid = torch.tensor([count_valid_tokens(micro_batches)], dtype=torch.float64)
    n_global = int(_all_reduce(n_valid, run.dp_group).item())
    run.loss_fn.set_global_tokens(n_global, run.dp_size, run.grad_accum)
    if run.pipeline:
        return float(engine.train_batch(iter(micro_batches)))
    total = torch.zeros((), dtype=torch.float64)
    for input_ids, labels in micro_batches:
        logits = engine(input_ids.to(engine.device))
        loss = run.loss_fn(logits, labels.to(engine.device))
        engine.backward(loss)
        engine.step()
        total += loss.detach().double().cpu()
    # The scaled micro losses sum to (dp x gas) x this rank's share of the token-weighted global loss.
    return float(_all_reduce(total, run.dp_group).item() / (run.dp_size * run.grad_accum))


def train(run: Run) -> dict:
    from ..data import GlobalBatchSampler, micro_batches

    cfg, engine, log = run.cfg, run.engine, run.log
    is_rank0 = run.rank == 0
    out = cfg.train.output_dir
    ckpt_dir = cfg.checkpoint_dir
    state = checkpoint.resume(engine, ckpt_dir) or {}
    sched = engine.lr_scheduler
    if not state and sched is not None and getattr(sched, "last_batch_iteration", 0) == -1:
        # DeepSpeed's warm-up schedulers report lr 0 until their first step(): without this the first
        # optimizer step of a fresh run would be wasted at lr 0.
        sched.step()
    start_step = int(state.get("step", 0))
    consumed = int(state.get("consumed_samples", 0))
    if start_step and is_rank0:
        log.info("resumed from %s at step %d (%d samples consumed)", checkpoint.latest_tag(ckpt_dir), start_step, consumed)

    sampler = GlobalBatchSampler(len(run.dataset), cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                 run.dp_rank, run.dp_size, cfg.train.seed, shuffle=cfg.train.shuffle,
                                 consumed_samples=consumed)
    batches = micro_batches(run.dataset, sampler)
    metrics = MetricsWriter(os.path.join(out, "metrics.jsonl"), append=start_step > 0) if is_rank0 else None
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    flops_per_step = flops_per_token(run.model_config, cfg.data.seq_len) * tokens_per_step
    bar = tqdm(total=cfg.train.steps, initial=start_step, disable=not is_rank0, desc="train", unit="step",
               dynamic_ncols=True)
    last_saved = None
    step = start_step
    for step in range(start_step + 1, cfg.train.steps + 1):
        lr = engine.get_lr()[0]
        t0 = time.perf_counter()
        loss = train_step(run, next(batches))
        dt = time.perf_counter() - t0
        grad_norm = engine.get_global_grad_norm()
        record = {
            "step": step, "loss": loss, "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_sec": tokens_per_step / dt, "samples_per_sec": cfg.train.global_batch_size / dt,
            "tflops_per_device": flops_per_step / dt / run.world / 1e12,
            "step_time": dt, "consumed_samples": sampler.consumed_samples,
        }
        if metrics:
            metrics.write(record)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        bar.update(1)
        if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
            last_saved = checkpoint.save(engine, ckpt_dir, step, {"step": step, "consumed_samples": sampler.consumed_samples},
                                         cfg.checkpoint.keep, is_rank0)
    bar.close()
    if step > start_step and (last_saved is None or not last_saved.endswith(checkpoint.tag_for(step))):
        last_saved = checkpoint.save(engine, ckpt_dir, step, {"step": step, "consumed_samples": sampler.consumed_samples},
                                     cfg.checkpoint.keep, is_rank0)
    summary = {}
    if is_rank0:
        metrics.close()
        recs = metrics.records
        if recs:
            plot_loss(recs, os.path.join(out, "loss.png"), f"{cfg.model.preset or cfg.model.path} on {run.world} ranks")
            timed = [r["tokens_per_sec"] for r in recs[1:]] or [recs[0]["tokens_per_sec"]]
            summary = {"first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"], "steps": len(recs),
                       "tokens_per_sec": sum(timed) / len(timed), "checkpoint": last_saved,
                       "metrics": os.path.join(out, "metrics.jsonl"), "plot": os.path.join(out, "loss.png")}
            log.info("\n".join([
                "done:",
                f"  loss        {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over {summary['steps']} steps",
                f"  throughput  {summary['tokens_per_sec']:.0f} tokens/s ({run.world} ranks)",
                f"  checkpoint  {last_saved}",
                f"  metrics     {summary['metrics']}",
                f"  loss curve  {summary['plot']}",
            ]))
    return summary
