"""What a non-finite (NaN/Inf) training loss does to a run: `train.nan_policy` skip | stop.

Both policies rest on DeepSpeed's own overflow handling: a non-finite loss gives non-finite gradients, and
the ZeRO optimizers (any stage) and the fp16 optimizer then discard the update (no optimizer or scheduler
step, `engine.skipped_steps` + 1). So the weights after a skipped step are the weights before it: "skip"
simply carries on, "stop" saves them and ends the run. Only ZeRO stage 0 in fp32 applies the update
anyway (`skips_nonfinite_steps`, a property of the DeepSpeed JSON that validate() also uses); validate()
refuses "skip" there, and at run time an applied non-finite update always stops the run, without saving,
because its weights are no longer trustworthy.
"""

from __future__ import annotations

from ..config import skips_nonfinite_steps

__all__ = ["NonFiniteLoss", "check", "skips_nonfinite_steps", "stop_message"]


class NonFiniteLoss(RuntimeError):
    """The run ended on a non-finite loss (policy "stop", or an update DeepSpeed did not discard)."""


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
