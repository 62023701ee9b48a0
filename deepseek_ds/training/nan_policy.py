"""What a non-finite (NaN/Inf) training loss does to a run: `train.nan_policy` skip | stop.

Both policies rest on DeepSpeed's own overflow handling: a non-finite loss gives non-finite gradients, and
the ZeRO optimizers (any stage) and the fp16 optimizer then discard the update (no optimizer or scheduler
step, `engine.skipped_steps` + 1). So the weights after a skipped step are the weights before it: "skip"
simply carries on, "stop" saves them and ends the run. Only ZeRO stage 0 in fp32 applies the update
anyway; validate() refuses "skip" there, and at run time an applied non-finite update always stops the
run, without saving, because its weights are no longer trustworthy.
"""

from __future__ import annotations

from ..config import precision, zero_stage

POLICIES = ("skip", "stop")


class NonFiniteLoss(RuntimeError):
    """The run ended on a non-finite loss (policy "stop", or an update DeepSpeed did not discard)."""


def skips_nonfinite_steps(ds: dict) -> bool:
    """Whether DeepSpeed discards an optimizer step with non-finite gradients under this DeepSpeed config."""
    stage, prec = zero_stage(ds), precision(ds)
    if prec == "fp16":
        return True  # the loss scaler's overflow check, at every stage
    if stage == 0:
        return False  # the plain torch optimizer (fp32; bf16 with stage 0 is refused by validate)
    if stage in (1, 2):
        # ZeRO-1/2 see it through the gradient norm (not computed with compute_grad_norm=false), and in bf16
        # only with bf16.check_grad_overflow (DeepSpeed's default: true).
        if not ds.get("zero_optimization", {}).get("compute_grad_norm", True):
            return False
        return prec != "bf16" or ds.get("bf16", {}).get("check_grad_overflow", True)
    return True  # ZeRO-3 always discards a step whose gradient norm is not finite


def config_errors(nan_policy: str, ds: dict) -> list[str]:
    if nan_policy not in POLICIES:
        return [f"train.nan_policy = {nan_policy!r}: use 'skip' (drop the step and go on) or 'stop' "
                "(save a checkpoint and end the run)"]
    if nan_policy == "skip" and not skips_nonfinite_steps(ds):
        return [f"train.nan_policy = 'skip' needs DeepSpeed to discard steps with non-finite gradients, which "
                f"ZeRO stage {zero_stage(ds)} in {precision(ds)} does not do (the update would be applied); use "
                "ZeRO >= 1 (e.g. ds_configs/zero1.json) or train.nan_policy: stop"]
    return []


def check(step: int, nan_policy: str, update_discarded: bool) -> bool:
    """Decide after a step whose loss was not finite. True: stop (save first: the weights are those before
    the step). Raises NonFiniteLoss when the update was applied."""
    if not update_discarded:
        raise NonFiniteLoss(f"step {step}: the loss is not finite and DeepSpeed applied the update anyway, so the "
                            "weights are no longer trustworthy; nothing was saved. Resume from the last checkpoint "
                            "(lower train.lr or raise warmup) and use ZeRO >= 1, which discards such steps.")
    return nan_policy == "stop"


def stop_message(step: int, saved: str) -> str:
    return (f"step {step}: the loss is not finite (train.nan_policy: stop). The update was discarded and the "
            f"weights from before this step were saved to {saved}; resuming continues after the bad batch. "
            "Lower train.lr, raise train.warmup_steps or set train.nan_policy: skip to carry on past such batches.")
