"""The learning-rate schedule at the start of a run and after a resume that changes train.steps.

DeepSpeed's WarmupCosineLR keeps only its step counter in a checkpoint; its length comes from the new run's
config, while the optimizer's learning rate comes back as the checkpoint's last value. Left alone, a resume with a
larger train.steps trains one step at the old schedule's end and then jumps to the new one. train.resume_schedule
makes it a choice: "keep" the checkpoint's schedule (past its end the rate stays at min_lr), or "replan" the warm-up +
cosine over the new train.steps from the current step."""

from __future__ import annotations

import logging


def start_lr_schedule(engine) -> None:
    """DeepSpeed's warm-up schedulers report lr 0 until their first step(): without this the first optimizer step
    of a fresh run would be wasted at lr 0."""
    sched = engine.lr_scheduler
    if sched is not None and getattr(sched, "last_batch_iteration", 0) == -1:
        sched.step()


def align_resumed_schedule(engine, saved_total: int | None, policy: str, log: logging.Logger | None) -> None:
    """After loading a checkpoint whose schedule spanned `saved_total` steps: apply `policy` ("keep" or "replan")
    and set the optimizer's rate to the chosen schedule's value at the current step."""
    sched = engine.lr_scheduler
    if sched is None or not hasattr(sched, "total_num_steps") or saved_total in (None, sched.total_num_steps):
        return
    new_total = sched.total_num_steps
    if policy == "keep":
        sched.total_num_steps = saved_total
    sched.step(sched.last_batch_iteration)  # recompute the rate of the current step under the chosen plan
    if log:
        what = (f"keeps the checkpoint's {saved_total}-step schedule (after its end the rate stays at min_lr)"
                if policy == "keep" else f"is re-planned over {new_total} steps from step {sched.last_batch_iteration}")
        other = "replan" if policy == "keep" else "keep"
        log.info("train.steps changed %d -> %d: the learning rate %s, now %.3e (train.resume_schedule: %s for the "
                 "other choice)", saved_total, new_total, what, sched.get_lr()[0], other)
