"""What each pipeline schedule (parallel.pipeline_schedule) can serve, checked before any process starts: one line
per refusal, naming the field and the fix."""

from __future__ import annotations


def min_micro_batches(schedule: str, stages: int) -> int:
    """The fewest micro-batches per step a schedule runs: ZB-H1 starts up to p forwards before its first backward;
    DualPipeV's V sends 2p micro-batches out before the first returns (DeepSpeed's DualPipeVSchedule asserts it).
    Without a pipeline, one."""
    if stages == 1:
        return 1
    return {"zb-h1": stages, "dualpipev": 2 * stages}.get(schedule, 1)


def pipeline_schedule_errors(schedule: str, stages: int, micro_batches: int, zero_stage: int,
                             precision: str) -> list[str]:
    if schedule == "1f1b":
        return []
    name = f"parallel.pipeline_schedule = {schedule}"
    if stages < 2:
        return [f"{name} orders the passes of a pipeline, but parallel.pipeline_stages = 1: set pipeline_stages >= 2 "
                "or leave pipeline_schedule at 1f1b"]
    errors = []
    least = min_micro_batches(schedule, stages)
    if micro_batches < least:
        errors.append(f"{name} needs at least {least} micro-batches per step with {stages} stages, but "
                      f"global_batch_size / (micro_batch_size x data-parallel size) = {micro_batches}: raise "
                      "train.global_batch_size or lower train.micro_batch_size")
    if schedule == "zb-h1" and zero_stage == 0:
        errors.append(f"{name} splits each backward in two past DeepSpeed's engine.backward, which ZeRO stage 0's "
                      "optimizer needs: use ZeRO-1 (ds_configs/zero1_pp.json)")
    if schedule == "zb-h1" and precision == "fp16":
        errors.append(f"{name} is not verified with fp16's dynamic loss scaling (it needs a GPU to test): use bf16 "
                      "(ds_configs/zero1_pp_bf16.json) or 1f1b")
    return errors
