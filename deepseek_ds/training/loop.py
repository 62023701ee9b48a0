"""The training loop: one global batch per optimizer step, identical for every parallel layout."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.async_save import SAVE_FAILED
from ..checkpoint.format import latest_tag, tag_for
from ..checkpoint.lock import checkpoint_lock
from ..checkpoint.resuming import resume
from ..checkpoint.saving import save
from ..data import GlobalBatchSampler, open_training_data
from ..launcher.supervise import STOP_RECORD
from ..utils.fs import write_json_atomic
from . import monitors, nan_policy
from .metrics import (
    PROC_CLEAR_REFS,
    MetricsWriter,
    NamedReduction,
    StepMeter,
    flops_per_token,
    peak_tflops,
    plot_loss,
    read_to_host,
    source_metrics,
)
from .objectives.base import task_scores_line
from .progress import Progress
from .router_stats import RouterStats, moe_layer_indices
from .run import Run
from .schedule import align_resumed_schedule, start_lr_schedule
from .signals import StopOnSignal


def _local_step(run: Run, micro_batches: list) -> torch.Tensor:
    """One optimizer step on this rank's share of the global batch, nothing read to the host (Objective.local_step)."""
    return run.objective.local_step(run, micro_batches)


def train_step(run: Run, micro_batches: list) -> float:
    """One optimizer step on this rank's share of the global batch; returns the global-batch loss (a collective and a
    host read of its own: the training loop reads it with the step's other metrics instead, recorded_step)."""
    total = _local_step(run, micro_batches)
    if run.pipeline:
        return float(total)
    # The scaled micro losses sum to (dp x sp x gas) x this rank's share of the token-weighted global loss.
    dist.all_reduce(total, group=run.layout.gradient_group)
    return float(total.item() / (run.layout.gradient_size * run.grad_accum))


def recorded_step(run: Run, batches, sampler: GlobalBatchSampler, meter: StepMeter, routers: RouterStats | None,
                  step: int, lr: float, stop: StopOnSignal | None = None) -> tuple[dict, float]:
    """The next global batch of `batches` (timed with the step), the step, and every per-step metric of
    metrics.jsonl: one loop step, also what `bench overhead` times. Returns (the record, `stop`'s flag reduced over
    the ranks with the metrics: 0, 1 when a rank asked to stop, SAVE_FAILED when a rank's background save failed;
    0 without `stop`).

    On a GPU the step's only host-device sync of ours is the one read of every metric at its end: the loss, MTP
    parts, balance losses and expert loads go through one SUM all-reduce, the memory, the stop flag and the router
    bias statistics through one MAX, and the balancer moves the biases on the device from the summed loads.
    DeepSpeed syncs on its own inside the step, which we cannot change: ZeRO 1/2's overflow check reads a flag
    (`.item()`) once per optimizer step unless check_grad_overflow is off; the pipeline engine reads its loss when it
    logs (steps_per_print) or feeds a monitor."""
    engine = run.engine
    skipped_before = engine.skipped_steps
    meter.start()
    batch = next(batches)
    if getattr(run.dataset, "positional", False):  # a blend: each row's source, for loss/<source>
        run.loss_fn.queue_row_groups([torch.from_numpy(run.dataset.sources_of(m)) for m in sampler.last],
                                     len(run.dataset.labels))
    local = _local_step(run, batch)
    # DeepSpeed discarded the update (fp16 overflow, non-finite gradients): no optimizer/scheduler step.
    skipped = engine.skipped_steps > skipped_before
    values, stop_asked = _reduced_metrics(run, meter, routers, local, skipped, stop)
    record = {
        "step": step, "loss": values.pop("loss"), "lr": lr, "grad_norm": values.pop("grad_norm"),
        **meter.stop(),  # after the read: on a GPU the step's time is its work's, not its launches'
        "memory_gb": values.pop("memory_gb"), "skipped": skipped, "skipped_steps": engine.skipped_steps,
        "consumed_samples": sampler.consumed_samples, **values,
    }
    return record, stop_asked


def _reduced_metrics(run: Run, meter: StepMeter, routers: RouterStats | None, local: torch.Tensor, skipped: bool,
                     stop: StopOnSignal | None) -> tuple[dict, float]:
    """loss, grad_norm, memory_gb (the largest peak over ranks), the objective's metrics (e.g. MTP losses), the balance
    losses and the expert-load statistics of the step, and the stop flag: one SUM and one MAX all-reduce (every rank
    calls it) and one read to the host. Bias statistics are taken after the balancer's update, so they go with the
    MAX (one rank reports each layer, the others hold -inf)."""
    engine, device, balancer = run.engine, run.engine.device, run.balancer
    if balancer and routers is None:
        raise ValueError("recorded_step: a model with a load balancer needs its RouterStats (loop.router_stats)")
    gas_dp = run.layout.gradient_size * run.grad_accum
    # The TP ranks of a replica compute the same losses: one of them counts, so the sums are over replicas.
    replica = 1.0 if run.layout.counts_once else 0.0
    objective = run.objective
    sums = NamedReduction(device)
    sums.add("loss", None if run.pipeline else local.reshape(1) * replica)
    for name, part in objective.metric_parts(run, device).items():  # the objective's own sums, by its names
        sums.add(f"parts/{name}", part * replica)
    sums.add("aux", balancer.take_aux() if balancer and balancer.s.has_aux else None)
    sums.add("indexer", run.indexer.take() if run.indexer else None)
    groups = run.loss_fn.take_group_sums(device) if hasattr(run.loss_fn, "take_group_sums") else None
    sums.add("groups", groups * replica if groups is not None else None)
    sums.add("load", routers.local_load() if routers else None)
    summed = sums.reduce(dist.ReduceOp.SUM)
    if balancer:  # the router biases move from the step's summed load, on the device, before the bias statistics
        balancer.apply_load(routers.own_rows(summed["load"]), skipped)
    maxes = NamedReduction(device)
    maxes.add("memory_gb", meter.memory())
    maxes.add("stop", stop.flag(run.saver is not None and run.saver.failed.is_set()) if stop else None)
    maxes.add("bias", routers.local_bias() if routers else None)
    maxed = maxes.reduce(dist.ReduceOp.MAX)
    grad_norm = engine.get_global_grad_norm()  # ZeRO 1/2: a device tensor; else a float or None
    norm_on_device = isinstance(grad_norm, torch.Tensor) and grad_norm.device == device
    kept = {"pipeline_loss": local.reshape(1) if run.pipeline else None,  # the same on every rank
            "grad_norm": grad_norm.detach().double().reshape(1) if norm_on_device else None,
            "group_norms": clipped.double() if run.clipping and (clipped := run.clipping.take()) is not None else None}
    host = read_to_host({**{f"sum/{k}": v for k, v in summed.items()}, **{f"max/{k}": v for k, v in maxed.items()},
                         **{k: v for k, v in kept.items() if v is not None}})

    # The scaled micro losses sum to (dp x sp x gas) x the token-weighted global loss.
    out: dict = {"loss": host["pipeline_loss"][0] if run.pipeline else host["sum/loss"][0] / gas_dp}
    out["grad_norm"] = host["grad_norm"][0] if norm_on_device else (float(grad_norm) if grad_norm is not None else None)
    out["memory_gb"] = host["max/memory_gb"][0]
    if "group_norms" in host:  # indexer.stage sparse: each group's norm, which it is clipped by
        out.update(zip(run.clipping.NAMES, host["group_norms"]))
    stop_asked = host["max/stop"][0] if stop is not None else 0.0  # async_save.SAVE_FAILED outranks a signal's 1
    if "sum/aux" in host:
        out.update(balancer.aux_metrics(host["sum/aux"]))
    if "sum/indexer" in host:  # loss becomes lm_loss + weight x indexer_loss
        out.update(run.indexer.metrics(host["sum/indexer"][0], out["loss"]))
    if groups is not None:
        out.update(source_metrics(run.dataset.labels, host["sum/groups"]))
    parts = {key.removeprefix("sum/parts/"): v for key, v in host.items() if key.startswith("sum/parts/")}
    if parts:
        out.update(objective.metrics(run, parts))
    if routers:
        out.update(routers.metrics(host["sum/load"], host.get("max/bias", [])))
    return out, stop_asked


def router_stats(run: Run) -> RouterStats | None:
    """The expert-load metrics of an MoE model (None for a dense one)."""
    if not moe_layer_indices(run.model_config):
        return None
    # The TP ranks of a replica route the same tokens: one of them counts (and reports the bias), so sums are exact.
    return RouterStats(run.engine.module, run.model_config, run.engine.device,
                       reports_bias=run.layout.writes_replica_files, counts_load=run.layout.counts_once,
                       load=run.balancer.load if run.balancer else None)


def train(run: Run, on_accepted=None) -> dict:
    """Train from the newest checkpoint (or from scratch) up to train.steps; returns rank 0's summary."""
    # The lock is held from before the resume (which removes .partial saves) to the last save. SIGTERM/SIGINT: finish
    # the step, save, exit cleanly.
    with checkpoint_lock(run), StopOnSignal(run.engine.device) as stop:
        return _train(run, stop, on_accepted)


def _train(run: Run, stop: StopOnSignal, on_accepted=None) -> dict:
    cfg, engine, log = run.cfg, run.engine, run.log
    is_rank0 = run.rank == 0
    run.objective.before_training(run)  # before the resume: the engine still holds the starting weights
    state = resume(run) or {}
    if on_accepted:  # the run, and its resume if any, passed every check: e.g. record resolved_config.yaml
        on_accepted()
    if not state:
        start_lr_schedule(engine)
    else:
        align_resumed_schedule(engine, state.get("schedule_steps"), cfg.train.resume_schedule,
                               log if is_rank0 else None)
    start_step = int(state.get("step", 0))
    consumed = int(state.get("consumed_samples", 0))
    if start_step >= cfg.train.steps:
        if is_rank0:
            log.info("already complete: %s holds step %d of train.steps %d; nothing to train (raise train.steps to "
                     "go on, or choose another train.output_dir for a new run)", latest_tag(cfg.checkpoint_dir),
                     start_step, cfg.train.steps)
        return {"steps": 0, "checkpoint": os.path.join(cfg.checkpoint_dir, latest_tag(cfg.checkpoint_dir))}
    if start_step and is_rank0:
        log.info("resumed from %s at step %d (%d samples consumed)", state["tag"], start_step,
                 consumed)
    sampler = run.objective.sampler(run, consumed)
    metrics = MetricsWriter(os.path.join(cfg.train.output_dir, "metrics.jsonl"), start_step) if is_rank0 else None
    last_saved, step = _steps(run, sampler, metrics, stop, start_step)
    if step > start_step and (last_saved is None or not last_saved.endswith(tag_for(step))):
        last_saved = save(run, step, sampler.consumed_samples)  # waits for a background save first
    elif run.saver is not None:
        run.saver.wait()  # the last step's background save, published before the job ends
    if not is_rank0:
        return {}
    if stop.stopping:  # saved: tells `deepseek-ds train` (launcher/supervise.py) that the job stopped cleanly
        write_json_atomic(Path(cfg.train.output_dir) / STOP_RECORD,
                          {"step": step, "signal": stop.received or "signal on another rank", "checkpoint": last_saved})
    _close(metrics, engine)
    return _summary(run, metrics.records, start_step, last_saved)


def step_meter(run: Run) -> StepMeter:
    cfg, engine = run.cfg, run.engine
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len * run.objective.sequences_per_sample
    flops_per_step = flops_per_token(run.model_config, cfg.data.seq_len) * tokens_per_step
    meter = StepMeter(flops_per_step, tokens_per_step, cfg.train.global_batch_size, run.world, engine.device,
                      peak_tflops(engine.device, cfg.train.peak_tflops))
    if run.rank == 0 and engine.device.type == "cuda" and meter.peak is None:
        run.log.warning("no peak TFLOP/s known for %s: set train.peak_tflops to get MFU", torch.cuda.get_device_name())
    if run.rank == 0 and not meter.resets:
        run.log.warning("memory_gb is each rank's peak RSS since it started: this OS cannot reset it per step "
                        "(no writable %s)", PROC_CLEAR_REFS)
    return meter


def _close(metrics: MetricsWriter | None, engine) -> None:
    if metrics:
        metrics.close()
        monitors.finish(engine)


def _steps(run: Run, sampler: GlobalBatchSampler, metrics: MetricsWriter | None, stop: StopOnSignal,
           start_step: int) -> tuple[str | None, int]:
    """The optimizer steps after `start_step`; returns (the last checkpoint saved, the last step trained)."""
    cfg, engine, log, objective = run.cfg, run.engine, run.log, run.objective
    batches = objective.batches(run, sampler)
    meter, routers = step_meter(run), router_stats(run)
    valid = (open_training_data(cfg.data, run.dataset_dir, cfg.train.seed, cfg.train.shuffle, "valid")
             if cfg.eval.interval else None)
    progress = Progress(cfg.train.steps, start_step, run.rank == 0, cfg.train.log_interval, log)
    skips = nan_policy.ConsecutiveSkips(cfg.train.max_consecutive_skips)
    last_saved, step = None, start_step
    for step in range(start_step + 1, cfg.train.steps + 1):
        lr = engine.get_lr()[0]
        try:
            record, stop_asked = recorded_step(run, batches, sampler, meter, routers, step, lr, stop)
            if stop_asked >= SAVE_FAILED:  # on every rank at this step: the flags went through one MAX
                raise run.saver.error()
        except Exception as e:
            if not nan_policy.at_min_loss_scale(e):
                raise
            # DeepSpeed raises on an overflowing step before any optimizer step, and the overflow flag is all-reduced,
            # so every rank gets here at the same step holding the weights of the last applied update: worth saving.
            saved = _save_and_close(run, step, sampler, progress, metrics)
            raise nan_policy.NonFiniteLoss(nan_policy.min_scale_message(step, saved, run.ds.get("fp16", {}), lr)) from e
        loss = record["loss"]
        if hasattr(run.dataset, "epochs"):  # a blend: the epochs of each source drawn so far (small ones wrap)
            record.update({f"epochs/{k}": v for k, v in run.dataset.epochs(sampler.consumed_samples).items()})
        if valid is not None and (step % cfg.eval.interval == 0 or step == cfg.train.steps):
            with stop.busy():
                record.update(objective.evaluate(run, valid))
            log.info("%s", objective.validation_message(step, record))
            if record.get("task_n"):
                log.info("step %d: %s", step, task_scores_line(record))
        if metrics:
            metrics.write(record)
            monitors.write(engine, record, sampler.consumed_samples)
        progress.update(step, record)
        if not math.isfinite(loss):
            if nan_policy.check(step, cfg.train.nan_policy, record["skipped"]):
                saved = _save_and_close(run, step, sampler, progress, metrics)
                raise nan_policy.NonFiniteLoss(nan_policy.stop_message(step, saved))
            log.warning("step %d: the loss is not finite; DeepSpeed discarded the update (train.nan_policy: skip)", step)
        if skips.after_step(record["skipped"]):
            saved = _save_and_close(run, step, sampler, progress, metrics)
            raise nan_policy.NonFiniteLoss(nan_policy.skips_message(step, skips.count, saved, lr))
        if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
            with stop.busy():
                last_saved = save(run, step, sampler.consumed_samples, background=run.saver is not None)
        if stop.requested(stop_asked) and objective.stops_at(run, step):
            log.info("stop requested (%s): saving step %d and exiting", stop.received or "signal on another rank", step)
            break
    progress.close()
    return last_saved, step


def _save_and_close(run: Run, step: int, sampler: GlobalBatchSampler, progress: Progress,
                    metrics: MetricsWriter | None) -> str:
    """Before a stop on discarded updates: save `step` (the weights are those before it), close the outputs;
    returns the checkpoint's path."""
    saved = save(run, step, sampler.consumed_samples)
    progress.close()
    _close(metrics, run.engine)
    return saved


def _summary(run: Run, records: list[dict], start_step: int, last_saved: str | None) -> dict:
    """The run's loss from its first step; throughput of this session only (a resumed run may have had another
    layout or hardware before)."""
    if not records:
        return {}
    out = run.cfg.train.output_dir
    plot_loss(records, os.path.join(out, "loss.png"), f"{run.cfg.model.preset or run.cfg.model.path} on {run.world} ranks")
    session = [r for r in records if r["step"] > start_step]
    timed = [r["tokens_per_sec"] for r in session[1:]] or [session[0]["tokens_per_sec"]]
    summary = {"first_loss": records[0]["loss"], "last_loss": records[-1]["loss"], "steps": len(records),
               "session_steps": len(session), "tokens_per_sec": sum(timed) / len(timed), "checkpoint": last_saved,
               "metrics": os.path.join(out, "metrics.jsonl"), "plot": os.path.join(out, "loss.png")}
    resumed = f", steps {start_step + 1}-{session[-1]['step']} after the resume" if start_step else ""
    run.log.info("\n".join([
        "done:",
        f"  loss        {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over {summary['steps']} steps",
        *run.objective.loss_lines(records),
        f"  throughput  {summary['tokens_per_sec']:.0f} tokens/s ({run.world} ranks{resumed})",
        *_validation_lines(run, records),
        f"  checkpoint  {last_saved}",
        f"  metrics     {summary['metrics']}",
        f"  loss curve  {summary['plot']}",
    ]))
    return summary


def _validation_lines(run: Run, records: list[dict]) -> list[str]:
    evals = [r for r in records if r.get("eval_loss") is not None]
    return run.objective.validation_lines(evals[-1]) if evals else []
