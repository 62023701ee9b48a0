"""One rank (started by tests/test_step_syncs.py with a one-rank launch's environment) that counts the host reads our
code makes in training.loop.recorded_step on the real engine (build_run), the stop flag included, as the training
loop calls it. A read is a call of a torch.Tensor method that hands a tensor's value to Python (or copies it to the
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
from deepseek_ds.data import GlobalBatchSampler, micro_batches
from deepseek_ds.training.loop import recorded_step, router_stats, step_meter
from deepseek_ds.training.main import parse_args
from deepseek_ds.training.schedule import start_lr_schedule
from deepseek_ds.training.setup import build_run
from deepseek_ds.training.signals import StopOnSignal

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
    result, args = argv[0], parse_args(argv[1:])
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, 1)
    run = build_run(cfg, ds)
    start_lr_schedule(run.engine)
    sampler = GlobalBatchSampler(len(run.dataset), cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                 run.dp_rank, run.dp_size, cfg.train.seed, shuffle=cfg.train.shuffle)
    batches, meter, routers = micro_batches(run.dataset, sampler), step_meter(run), router_stats(run)
    counter = Counter()
    counter.patch()
    steps = []
    with StopOnSignal(run.engine.device) as stop:
        for step in range(1, cfg.train.steps + 1):
            lr = run.engine.get_lr()[0]
            counter.active, counter.found = True, []
            record, asked = recorded_step(run, batches, sampler, meter, routers, step, lr, stop)
            counter.active = False
            steps.append({"reads": counter.found, "record": record, "stop": asked,
                          "balancer": run.balancer is not None, "mtp_depth": run.loss_fn.mtp_depth})
    with open(result, "w") as f:
        json.dump(steps, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
