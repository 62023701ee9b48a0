"""One rank (started by tests/test_async_save.py with a one-rank launch's environment) that checks what a background
save (checkpoint.async) holds when the training step after it runs while its state is still being copied: the
background copy (Writes.copy in the writer thread) starts only once the step's update is due (it reached the saver's
hold, or with the hold off it is done), so the update reaches the state before the copy unless the saver holds it.
An order set in the run's own progress, not a delay: a faster or slower host copies at the same point. Saves on the real engine (build_run), steps through training.loop.train_step:

  step 1, sync save of step 1 (the reference), background save of step 2, step 2 -> held: the tags' tensors equal
  step 2 done, sync save of step 3 (its reference), background save of step 4 with the hold off, step 3 -> differ

Writes {"held_equal", "update_wait_s", "step_changed_state", "unheld_equal", "tags_verify"} to argv[1]; the rest of
argv is train.py's."""

import json
import os
import sys
import threading

import torch

from deepseek_ds.bench.checkpoint_bench import training_steps
from deepseek_ds.checkpoint import async_save, saving
from deepseek_ds.checkpoint.integrity import check_tag
from deepseek_ds.config import load_and_validate
from deepseek_ds.training.main import parse_args
from deepseek_ds.training.setup import build_run
from deepseek_ds.utils.private_api import TAKE_MODEL_STEP


def tensors(tag_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a tag's DeepSpeed, RNG and buffer files by file and key path."""
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)

    for root, _, files in os.walk(tag_dir):
        for name in files:
            if name.endswith(".pt"):
                path = os.path.join(root, name)
                walk(os.path.relpath(path, tag_dir), torch.load(path, weights_only=False))
    return out


def same(a: str, b: str) -> bool:
    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def main(argv: list[str]) -> int:
    result, args = argv[0], parse_args(argv[1:])
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, 1)
    run = build_run(cfg, ds)
    step = training_steps(run)  # the loop's own train_step on the run's batches in order

    copy, update, release = saving.Writes.copy, getattr(type(run.engine), TAKE_MODEL_STEP), async_save.AsyncSaver._release
    update_due = threading.Event()  # the step's update reached the saver's hold (held) or is done (hold off)

    def update_then_signal(self, *a, **k):
        out = update(self, *a, **k)
        update_due.set()
        return out

    def release_then_signal(self):  # the held update releases the hold first, then waits for the copy
        holding = self._held is not None  # the hold's own release (saver.wait() releases again, finding none)
        release(self)
        if holding:
            update_due.set()

    def late_copy(self, *a, **k):
        if threading.current_thread() is not threading.main_thread():  # a background save's copy, not a sync one
            assert update_due.wait(timeout=600), "the step after the background save never reached its update"
        return copy(self, *a, **k)

    setattr(type(run.engine), TAKE_MODEL_STEP, update_then_signal)
    async_save.AsyncSaver._release = release_then_signal
    saving.Writes.copy = late_copy
    tag = lambda s: os.path.join(cfg.checkpoint_dir, f"step{s:08d}")  # noqa: E731
    out = {}
    step()
    saving.save(run, 1, 0)
    update_due.clear()
    saving.save(run, 2, 0, background=True)
    step()
    out["update_wait_s"] = run.saver.update_wait_s
    run.saver.wait()
    out["held_equal"] = same(tag(1), tag(2))
    saving.save(run, 3, 0)
    out["step_changed_state"] = not same(tag(1), tag(3))
    async_save.AsyncSaver._hold_next_update = lambda self, engine: None  # the hold off: the copy races the update
    update_due.clear()
    saving.save(run, 4, 0, background=True)
    step()
    run.saver.wait()
    out["unheld_equal"] = same(tag(3), tag(4))
    out["tags_verify"] = all(check_tag(tag(s)).ok for s in (1, 2, 3, 4))
    with open(result, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
