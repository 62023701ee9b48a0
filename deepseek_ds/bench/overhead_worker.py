"""The per-rank worker of `deepseek-ds bench overhead`, started by bench/overhead.py under the `deepspeed` launcher.

`--against bare` (1 rank): the toolkit's loop step (training.loop.recorded_step: the step and every metric of
metrics.jsonl), a bare transformers + torch.optim.AdamW step on a copy of the same initial weights, and the bare
DeepSpeed engine (a second run built from the same config, so the same engine, model and initial weights, driven by
forward, backward and step alone), on the same global batches, in the same process (same threads), alternating
step by step (each in turn first) so that a shared host's load hits all three alike. `--against trainer`: the
toolkit's steps and transformers.Trainer's on the same model, batches and DeepSpeed JSON (its DeepSpeed
integration, on CPU too, checked: Trainer's engine runs the JSON's ZeRO stage; `--trainer-deepspeed no`: plain
Trainer, DDP), alternating step by step too (our step runs in Trainer's step-end callback). Rank 0 writes the
seconds and losses of every step to --result.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import time

import torch
import torch.nn.functional as F

from ..config import load_and_validate, precision, zero_stage
from ..data import micro_batches
from ..models.hf_io import to_hf_model
from ..models.loss import IGNORE_INDEX, valid_token_counts
from ..models.pipeline import local_layers, split_micro_batch, to_device
from ..training.loop import recorded_step, router_stats, step_meter
from ..training.metrics import MetricsWriter
from ..training.schedule import start_lr_schedule
from ..training.setup import build_run
from ..utils.cli_args import add_run_args
from .worker import add_timing_args, write_result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OurLoop:
    """The toolkit's loop step, metrics.jsonl included (rank 0)."""

    def __init__(self, run):
        self.run, self.sampler = run, run.sampler()
        self.batches = micro_batches(run.dataset, self.sampler)
        self.meter, self.routers = step_meter(run), router_stats(run)
        path = os.path.join(run.cfg.train.output_dir, "metrics.jsonl")
        self.metrics = MetricsWriter(path) if run.rank == 0 else None
        self.step = 0
        start_lr_schedule(run.engine)

    def __call__(self) -> tuple[float, float, float]:
        """(seconds, loss, the step's learning rate)."""
        self.step += 1
        start = time.perf_counter()
        lr = self.run.engine.get_lr()[0]
        record, _ = recorded_step(self.run, self.batches, self.sampler, self.meter, self.routers, self.step, lr)
        if self.metrics:
            self.metrics.write(record)
        return time.perf_counter() - start, record["loss"], lr


class BareLoop:
    """transformers' model and torch's AdamW, nothing else: token-weighted cross-entropy over the global batch,
    gradient clipping, the optimizer step. The same math as one rank of the toolkit's step."""

    def __init__(self, run, model):
        cfg = run.cfg.train
        self.model, self.device = model.to(run.engine.device).train(), run.engine.device
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.grad_clip = cfg.grad_clip
        self.batches = micro_batches(run.dataset, run.sampler())

    def __call__(self, lr: float) -> tuple[float, float]:
        """(seconds, loss) of one step at learning rate `lr` (ours: the same schedule)."""
        start = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = next(self.batches)
        tokens = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in batch)
        total = torch.zeros((), device=self.device)
        for input_ids, labels, *_ in batch:
            logits = self.model(input_ids=input_ids.to(self.device)).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.to(self.device).reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / tokens
            loss.backward()
            total += loss.detach()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - start, float(total)


class EngineLoop:
    """DeepSpeed's engine with nothing of the loop around it: per micro-batch forward, the run's loss, backward and
    step. The loss's token weights come from the global batch's counts on the host (1 rank: nothing to reduce); no
    metrics, no host read but DeepSpeed's own. Its run is a second one built from the same config (same initial
    weights and schedule), so it walks the same weights ours does, step by step, without sharing ours: its model's
    hooks (expert load, balance losses) still run, but nothing applies its load to the router biases."""

    def __init__(self, run):
        if run.pipeline or run.world != 1:
            raise ValueError("EngineLoop: one rank, no pipeline (its loss needs no reduction)")
        self.run, self.batches = run, micro_batches(run.dataset, run.sampler())
        start_lr_schedule(run.engine)

    def __call__(self) -> tuple[float, float]:
        """(seconds, loss) of one step."""
        engine, loss_fn = self.run.engine, self.run.loss_fn
        start = time.perf_counter()
        batch = next(self.batches)
        loss_fn.set_global_tokens(valid_token_counts(batch, loss_fn.mtp_depth), 1, self.run.grad_accum)
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        for inputs, labels in (split_micro_batch(mb, mtp=loss_fn.mtp_depth > 0) for mb in batch):
            loss = loss_fn(engine(to_device(inputs, engine.device)), to_device(labels, engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        _sync(engine.device)
        seconds = time.perf_counter() - start
        return seconds, float(total) / self.run.grad_accum


def hf_copy(run, compiled: bool):
    """An independent transformers model holding a copy of the run's initial weights (regionally compiled like
    ours when `compiled`)."""
    model = copy.deepcopy(to_hf_model(local_layers(run.engine.module), run.model_config))
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    return model


def build(args: argparse.Namespace, world: int, compiled: bool, extra: tuple[str, ...] = ()):
    sets = args.set + [f"train.compile={str(compiled).lower()}", "eval.interval=0", *extra]
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, sets, world)
    return build_run(cfg, ds), ds


def against_bare(args: argparse.Namespace, compiled: bool) -> dict:
    run, _ = build(args, 1, compiled)
    ours, bare = OurLoop(run), BareLoop(run, hf_copy(run, compiled))
    engine_dir = os.path.join(run.cfg.train.output_dir, "engine")
    engine = EngineLoop(build(args, 1, compiled, (f"train.output_dir={engine_dir}",))[0])
    steps = []
    for i in range(args.warmup + args.steps):
        lr = run.engine.get_lr()[0]  # what our step reads and uses: the bare loop takes the same schedule
        loops = [("ours", lambda: ours()[:2]), ("bare", functools.partial(bare, lr)), ("engine", engine)]
        # Each loop takes each place in the round (first, second, third) in turn: no place favours one.
        measured = {name: loop() for name, loop in loops[i % 3:] + loops[:i % 3]}
        step = {f"{name}_{key}": value for name, (s, loss) in measured.items()
                for key, value in (("s", s), ("loss", loss))}
        steps.append({**step, "timed": i >= args.warmup})
    return {"variant": "compiled" if compiled else "eager", "steps": steps, "threads": torch.get_num_threads()}


def against_trainer(args: argparse.Namespace, world: int, use_deepspeed: bool) -> dict:
    """Trainer's steps with ours in between: each of our steps runs in Trainer's step-end callback, so both see the
    same load. Trainer's step is the time from the end of our previous step to its step end (its data loading and
    logging included, as ours includes our data and metrics)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments  # this mode only: ~2 s of imports

    run, ds = build(args, world, False)
    model = hf_copy(run, False)  # before our first step changes the weights
    ours = OurLoop(run)
    cfg = run.cfg.train
    # This rank's samples of as many global batches (Trainer deals them to the ranks in its own order).
    batches = micro_batches(run.dataset, run.sampler())
    samples = [s for _ in range(args.warmup + args.steps) for s in _samples(next(batches))] * world

    class Alternate(TrainerCallback):
        def __init__(self):
            self.steps, self.engine = [], None

        def on_train_begin(self, *_, **__):
            if use_deepspeed:
                self.engine = _trainer_engine(trainer, zero_stage(ds))
            self.mark = time.perf_counter()

        def on_step_end(self, *_, **__):
            _sync(run.engine.device)
            trainer_s = time.perf_counter() - self.mark
            ours_s, loss, _ = ours()
            self.steps.append({"ours_s": ours_s, "ours_loss": loss, "trainer_s": trainer_s,
                               "timed": len(self.steps) >= args.warmup})
            self.mark = time.perf_counter()

    alternate = Alternate()
    on_cpu = run.engine.device.type == "cpu"
    # Trainer brings its own (constant) schedule; the rest of the JSON is the run's own, its precision too.
    trainer_ds, extra = None, {}
    if use_deepspeed:
        trainer_ds = {k: v for k, v in ds.items() if k != "scheduler"}
        extra = {"bf16": precision(ds) == "bf16", "fp16": precision(ds) == "fp16"}
    if use_deepspeed and on_cpu:
        from accelerate import PartialState
        # accelerate's _prepare_backend finds no backend on CPU (1 process): build its gloo DeepSpeed state, keep it
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        extra["accelerator_config"] = {"use_configured_state": True}
    targs = TrainingArguments(
        output_dir=os.path.join(cfg.output_dir, "trainer"), per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=run.grad_accum, max_steps=args.warmup + args.steps, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay, adam_beta1=cfg.beta1, adam_beta2=cfg.beta2, adam_epsilon=cfg.eps,
        max_grad_norm=cfg.grad_clip or 0.0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to=[], dataloader_num_workers=0, deepspeed=trainer_ds, seed=cfg.seed, disable_tqdm=True,
        use_cpu=on_cpu, **extra)  # use_cpu: bf16's device check (the configured state keeps its device)
    trainer = Trainer(model=model, args=targs, train_dataset=samples, callbacks=[alternate])
    result = trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    steps = alternate.steps
    for i, s in enumerate(steps):
        s["trainer_loss"] = losses[i] if i < len(losses) else None
    engine = {"trainer_zero_stage": alternate.engine.zero_optimization_stage(),
              "trainer_dp_world_size": alternate.engine.dp_world_size} if use_deepspeed else {}
    return {"variant": "trainer+deepspeed" if use_deepspeed else "trainer (no deepspeed)", "steps": steps,
            "threads": torch.get_num_threads(), "trainer_train_loss": result.training_loss, **engine}


def _trainer_engine(trainer, stage: int):
    """Trainer's DeepSpeed engine, checked: its wrapped model is a DeepSpeedEngine under the JSON's ZeRO stage."""
    import deepspeed

    engine = trainer.model_wrapped
    if not isinstance(engine, deepspeed.DeepSpeedEngine) or engine.zero_optimization_stage() != stage:
        got = type(engine).__name__
        if isinstance(engine, deepspeed.DeepSpeedEngine):
            got += f" at ZeRO stage {engine.zero_optimization_stage()}"
        raise RuntimeError(f"transformers.Trainer did not run DeepSpeed at the JSON's ZeRO stage {stage}: its "
                           f"wrapped model is a {got}")
    return engine


def _samples(batch: list) -> list[dict]:
    """This rank's samples of one global batch as Trainer examples: transformers shifts labels itself, so the
    labels are the input ids (a sample's last target falls away, as it does for every Trainer user)."""
    return [{"input_ids": ids, "labels": ids.clone()} for mb in batch for ids in mb[0]]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="One `bench overhead` rank (started by `deepspeed --module`).")
    add_run_args(p)
    p.add_argument("--against", choices=("bare", "trainer"), required=True)
    p.add_argument("--compile", choices=("no", "yes", "both"), default="no", help="bare: train.compile variants")
    p.add_argument("--trainer-deepspeed", choices=("yes", "no"), default="yes")
    add_timing_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.against == "bare":
        variants = [against_bare(args, c) for c in {"no": [False], "yes": [True], "both": [False, True]}[args.compile]]
    else:
        variants = [against_trainer(args, world, args.trainer_deepspeed == "yes")]
    return write_result(args.result, variants)


if __name__ == "__main__":
    sys.exit(main())
