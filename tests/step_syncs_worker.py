"""One rank (started by tests/test_step_syncs.py with a one-rank launch's environment) that counts the host reads our
code makes in training.loop.recorded_step on the real engine (build_run) and in the real training loop (loop.train),
the stop flag included. A read is a call of a torch.Tensor method that hands a tensor's value to Python (or copies it to the
host) whose calling frame is in deepseek_ds/ or transformers/; on a GPU each is a host-device sync. torch.tensor /
as_tensor calls with a device from our code count too (a host-to-device copy of Python values, blocking: a sync).
Writes, per step, the reads found ("file:line function method") and the records to argv[1]; the rest of argv is
train.py's."""

import json
import os
import sys

import torch
import transformers

import deepseek_ds
from deepseek_ds.config import load_and_validate
from deepseek_ds.training import loop
from deepseek_ds.training.main import parse_args
from deepseek_ds.training.setup import build_run

PACKAGE = os.path.dirname(os.path.abspath(deepseek_ds.__file__)) + os.sep
# The model's code as we call it counts too (e.g. its attention-mask builder's packed-sequence check); DeepSpeed's
# own reads inside the engine do not.
TRANSFORMERS = os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
FACTORIES = ("tensor", "as_tensor")


class Counter:
    def __init__(self):
        self.active, self.found = False, []

    def note(self, what: str) -> None:
        frame = sys._getframe(2)  # the caller of the patched method
        path = os.path.abspath(frame.f_code.co_filename)
        if self.active and path.startswith((PACKAGE, TRANSFORMERS)):
            where = path[len(PACKAGE):] if path.startswith(PACKAGE) else "transformers/" + path[len(TRANSFORMERS):]
            self.found.append(f"{where}:{frame.f_lineno} {frame.f_code.co_name} {what}")

    def patch(self) -> None:
        for name in READS:
            setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        for name in FACTORIES:
            setattr(torch, name, self._wrap_factory(getattr(torch, name), name))

    def _wrap(self, real, name):
        def read(tensor, *args, **kwargs):
            self.note(name)
            return real(tensor, *args, **kwargs)
        return read

    def _wrap_factory(self, real, name):
        def make(*args, **kwargs):
            if kwargs.get("device") is not None:
                self.note(f"torch.{name}(device=...)")
            return real(*args, **kwargs)
        return make


def main(argv: list[str]) -> int:
    """The real training loop (loop.train: its sampler, batches, stop flag and saves), each of its steps counted:
    loop.recorded_step, which the loop calls by its module's name, wrapped to switch the counter on around it."""
    result, args = argv[0], parse_args(argv[1:])
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, 1)
    run = build_run(cfg, ds)
    counter, steps, step = Counter(), [], loop.recorded_step

    def counted(*step_args, **kwargs):
        counter.active, counter.found = True, []
        record, asked = step(*step_args, **kwargs)
        counter.active = False
        steps.append({"reads": counter.found, "record": record, "stop": asked,
                      "balancer": run.balancer is not None, "mtp_depth": run.loss_fn.mtp_depth})
        return record, asked

    counter.patch()
    loop.recorded_step = counted
    try:
        loop.train(run)
    finally:
        loop.recorded_step = step
    with open(result, "w") as f:
        json.dump(steps, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
