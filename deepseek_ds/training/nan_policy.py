"""What a non-finite (NaN/Inf) training loss does to a run: `train.nan_policy` skip | stop.

Both policies rest on DeepSpeed's own overflow handling: a non-finite loss gives non-finite gradients, and
the ZeRO optimizers (any stage) and the fp16 optimizer then discard the update (no optimizer or scheduler
step, `engine.skipped_steps` + 1). So the weights after a skipped step are the weights before it: "skip"
simply carries on, "stop" saves them and ends the run. Only ZeRO stage 0 in fp32 applies the update
anyway (`skips_nonfinite_steps`, a property of the DeepSpeed JSON that validate() also uses); validate()
refuses "skip" there, and at run time an applied non-finite update always stops the run, without saving,
because its weights are no longer trustworthy.

Whatever the policy, discarded updates have two limits, each ending the run with a checkpoint and a message
instead of a DeepSpeed traceback: `train.max_consecutive_skips` steps discarded in a row, and fp16's dynamic loss
scaler overflowing at `fp16.min_loss_scale` (DeepSpeed raises then).
"""

from __future__ import annotations

from deepspeed.runtime.constants import FP16_MIN_LOSS_SCALE, FP16_MIN_LOSS_SCALE_DEFAULT

from ..config import skips_nonfinite_steps

__all__ = ["ConsecutiveSkips", "NonFiniteLoss", "at_min_loss_scale", "check", "min_scale_message",
           "skips_message", "skips_nonfinite_steps", "stop_message"]

# DeepSpeed's DynamicLossScaler.update_scale raises a plain Exception with this message (raise_error_at_min_scale,
# on by default) when a step overflows with the scale already at its minimum: the message is all that tells it apart.
MIN_SCALE_ERROR = "Current loss scale already at minimum"


class NonFiniteLoss(RuntimeError):
    """The run ended on non-finite updates: a non-finite loss (policy "stop", or an update DeepSpeed did not
    discard), too many discarded steps in a row, or fp16's loss scale at its minimum."""


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


def at_min_loss_scale(error: BaseException) -> bool:
    """True for DeepSpeed's exception of an fp16 step that overflowed at fp16.min_loss_scale."""
    return type(error) is Exception and str(error).startswith(MIN_SCALE_ERROR)


def min_scale_message(step: int, saved: str, fp16: dict, lr: float) -> str:
    min_scale = fp16.get(FP16_MIN_LOSS_SCALE, FP16_MIN_LOSS_SCALE_DEFAULT)
    return (f"step {step}: the fp16 gradients overflow even at the smallest loss scale (fp16.{FP16_MIN_LOSS_SCALE}: "
            f"{min_scale}), so the model diverges at train.lr {lr:.3g}. No update was applied and the weights from "
            f"before this step were saved to {saved} (a resume restores the loss scale too). Lower train.lr or raise "
            "train.warmup_steps and resume; a lower fp16.min_loss_scale leaves the scaler room, fp16.initial_scale_power "
            "sets where a fresh run's scale starts, and bf16 needs no loss scale.")


class ConsecutiveSkips:
    """Counts the optimizer steps DeepSpeed discarded in a row; `limit` 0 means no limit."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def after_step(self, skipped: bool) -> bool:
        """True when this step makes `limit` discarded in a row: stop (save first: the weights are those before
        the skipped steps)."""
        self.count = self.count + 1 if skipped else 0
        return self.limit > 0 and self.count >= self.limit


def skips_message(step: int, count: int, saved: str, lr: float) -> str:
    return (f"step {step}: DeepSpeed discarded the last {count} updates in a row (train.max_consecutive_skips: "
            f"{count}): their gradients were not finite (a non-finite loss, or fp16 overflow). The weights from before "
            f"those steps were saved to {saved}; resuming continues after these batches. Lower train.lr (it is "
            f"{lr:.3g}) or raise train.warmup_steps; raise train.max_consecutive_skips (0: no limit) if fp16's loss "
            "scale is still settling.")
