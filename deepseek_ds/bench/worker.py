"""The per-rank benchmark worker, started by bench/launch.py under the `deepspeed` launcher.

`deepspeed --module deepseek_ds.bench.worker --config RECIPE --global-batch-sizes 16,32 ...` builds the run
once per global batch size with the training code (build_run), runs warm-up and timed optimizer steps with
train_step, then one more, untimed step during which it measures the bytes of model state this rank holds.
Rank 0 writes every rank's report, per global batch size, to one JSON file (--result).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import deepspeed
import psutil
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..config import load_and_validate, precision, zero_stage
from ..data import micro_batches
from ..models.muon import is_muon, layer_shape
from ..parallel.zero_bubble import BackwardInput, BackwardWeight
from ..training.loop import train_step
from ..training.metrics import flops_per_token, peak_memory_bytes, peak_tflops
from ..training.schedule import start_lr_schedule
from ..training.setup import build_run
from ..utils.cli_args import add_local_rank, add_run_args
from ..utils.fs import write_json_atomic
from ..utils.private_api import (
    ZERO3_GRAD_PARTITIONS,
    ZERO12_MUON_STAGED_MOMENTUM,
    pipeline_instructions,
    set_pipeline_instructions,
)
from ..utils.system import cpu_model
from .saved_activations import SavedActivations, storage_key

PHASES = ("compute", "optimizer")
CATEGORIES = ("params", "grads", "optimizer", "buffers")
MODEL_STATES = ("params", "grads", "optimizer")
HELD = (*CATEGORIES, "offloaded")  # what held_bytes() reports
# A pipeline stage's compute: forward and backward, the zero-bubble schedule's two halves of a backward too.
COMPUTE_INSTRUCTIONS = (schedule.ForwardPass, schedule.BackwardPass, BackwardInput, BackwardWeight)

# Where DeepSpeed's optimizers (ZeRO 1/2, ZeRO 3, FP16/BF16 at stage 0) keep fp32 master weights and gradient
# partitions. A name that a DeepSpeed version lacks is simply absent; what it holds then lands in "buffers".
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat",
                 "fp32_groups_flat_partition")
_GRAD_ATTRS = ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer",
               ZERO3_GRAD_PARTITIONS, "fp32_groups_gradients",
               "fp32_groups_gradients_flat", "fp32_groups_gradient_flat_partition")
# The gradient communication ("IPG") buckets of ZeRO 1/2 and ZeRO-3, by dtype. While a backward fills one, the
# parameters' .grad are views into it: it is claimed as a buffer first, or it would count as gradients.
_BUCKETS_ATTR = "ipg_buckets"


# ------------------------------------------------------------------------------------------ what a rank holds
def _walk(obj, depth: int = 0, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Tensors reachable from `obj` through containers and DeepSpeed / torch.optim objects (never through a
    module: the model's own tensors are counted from its parameters)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth > 6 or id(obj) in seen or isinstance(obj, torch.nn.Module):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        items = obj
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return
    for item in items:
        yield from _walk(item, depth + 1, seen)


def held_bytes(engine) -> tuple[dict[str, int], str | None]:
    """Bytes of the distinct storages this rank holds, by category, and the device of the optimizer states.
    "offloaded" is the part of the model states (params, grads, optimizer) in host memory while the engine
    computes on an accelerator.

    params: the model's parameters (ZeRO 1/2: the flat buffer they are views of, alignment padding included;
    ZeRO-3: the `ds_tensor` partitions plus parameters kept whole, i.e. persistent ones). optimizer: fp32 master
    weights and the optimizer's state tensors (Adam's exp_avg and exp_avg_sq; not the scalar step counter).
    With Muon, ZeRO 1/2's staged copy of the momentum counts as optimizer state too. grads: parameters' .grad /
    DeepSpeed's grad_accum, and the optimizer's gradient partitions. buffers:
    the gradient communication buckets (claimed first, before the gradients that are views into them during a
    backward) and anything else the optimizer holds. A storage shared by several views counts once, in the first
    category that claims it: params, buckets, grads, optimizer, other buffers."""
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)  # the torch optimizer inside DeepSpeed's wrapper, if any
    params = list(engine.module.parameters())
    masters = [t for name in _MASTER_ATTRS for t in _walk(getattr(zero, name, None))]
    states = [v for state in inner.state.values() for key, v in state.items()
              if key != "step" and isinstance(v, torch.Tensor)]
    states += list(_walk(getattr(zero, ZERO12_MUON_STAGED_MOMENTUM, None)))
    buckets = getattr(zero, _BUCKETS_ATTR, None)
    claims = [
        ("params", [t for p in params for t in (p.data, getattr(p, "ds_tensor", None)) if t is not None]),
        ("buffers", [t for b in (buckets.values() if isinstance(buckets, dict) else ())
                     for t in _walk(getattr(b, "buffer", None))]),
        ("grads", [t for p in params for t in (p.grad, getattr(p, "grad_accum", None)) if t is not None]
                  + [m.grad for m in masters if m.grad is not None]
                  + [t for name in _GRAD_ATTRS for t in _walk(getattr(zero, name, None))]),
        ("optimizer", [m.data for m in masters] + states),
        ("buffers", list(_walk(zero))),
    ]
    claimed: set[tuple] = set()
    held = dict.fromkeys(HELD, 0)
    for category, tensors in claims:
        for t in tensors:
            key = storage_key(t)
            if key is not None and key not in claimed:
                claimed.add(key)
                held[category] += key[2]
                if category in MODEL_STATES and t.device.type == "cpu" and engine.device.type != "cpu":
                    held["offloaded"] += key[2]
    device = str(states[0].device) if states else (str(masters[0].device) if masters else None)
    return held, device


class StateProbe:
    """Per category, the most this rank held at the snapshots taken while armed: around optimizer-phase calls and,
    for the communication buffers only, at the end of every backward (instrument())."""

    def __init__(self, engine):
        self.engine = engine
        self.armed = False
        self.peak = dict.fromkeys(HELD, 0)
        self.optimizer_device: str | None = None

    def snapshot(self, categories: tuple[str, ...] = HELD) -> None:
        if not self.armed:
            return
        held, device = held_bytes(self.engine)
        self.peak = {k: max(v, held[k]) if k in categories else v for k, v in self.peak.items()}
        self.optimizer_device = device or self.optimizer_device


# ------------------------------------------------------------------------------------------ where time goes
class PhaseClock:
    """Seconds per phase since reset(): `compute` is forward + backward (the work of a pipeline stage),
    `optimizer` the optimizer step and the gradient reductions a pipeline runs just before it; `span` runs from
    the start of the first compute call to the end of the last, `first` and `last` are those two instants on
    time.perf_counter's clock (CLOCK_MONOTONIC: one clock for every process of a host). `instructions`: per
    compute instruction ("ForwardPass", "BackwardInput", ...; DualPipeV's with its phase, "ForwardPass/1"), the
    [seconds, calls] of its calls. On GPU each timed call ends with a synchronize, so asynchronous kernels are
    charged to the phase that launched them."""

    def __init__(self, device: torch.device):
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.instructions: dict[str, list] = {}
        self._first: float | None = None
        self._last = 0.0

    @property
    def span(self) -> float:
        return self._last - self._first if self._first is not None else 0.0

    @property
    def first(self) -> float | None:
        return self._first

    @property
    def last(self) -> float | None:
        return self._last if self._first is not None else None

    def wrap(self, phase: str, fn: Callable, around: Callable[[], None] | None = None,
             name: str | None = None) -> Callable:
        def timed(*args, **kwargs):
            if around:
                around()  # outside the timed span: snapshots are slow
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self._sync:
                self._sync()
            end = time.perf_counter()
            self.seconds[phase] += end - start
            if phase == "compute":
                self._first = start if self._first is None else self._first
                self._last = end
            if name:
                key = name if kwargs.get("phase") is None else f"{name}/{kwargs['phase']}"
                total = self.instructions.setdefault(key, [0.0, 0])
                total[0] += end - start
                total[1] += 1
            if around:
                around()
            return out
        return timed


def instrument(engine, clock: PhaseClock, probe: StateProbe) -> list:
    """Time this engine's phases without changing what it computes, and snapshot what the rank holds at the same
    points of every step whatever the ZeRO stage; returns the hooks' handles. The pipeline engine dispatches every
    schedule instruction through its instruction table, so an instance copy with timed entries shadows the
    class's (the engine's own class: zb-h1's and DualPipeV's engines add instructions and replace methods); the
    plain engine is driven through forward/backward/step, wrapped on the instance."""
    if isinstance(engine, PipelineEngine):
        table = pipeline_instructions(type(engine))
        for instr in (i for i in COMPUTE_INSTRUCTIONS if i in table):
            table[instr] = clock.wrap("compute", table[instr], name=instr.__name__)
        for instr in (schedule.ReduceTiedGrads, schedule.ReduceGrads, schedule.OptimizerStep):
            table[instr] = clock.wrap("optimizer", table[instr], around=probe.snapshot)
        set_pipeline_instructions(engine, table)
    else:
        engine.forward = clock.wrap("compute", engine.forward)
        engine.backward = clock.wrap("compute", engine.backward)
        engine.step = clock.wrap("optimizer", engine.step, around=probe.snapshot)
    # ZeRO-2 frees its gradient bucket at the end of every backward (DeepSpeed's IPG epilogue), before any
    # optimizer call; ZeRO 1 and 3 keep theirs. The first parameter's gradient is the stage's last (autograd
    # runs backwards), and its hook fires before that epilogue: ZeRO 1/2's buffers are seen at the height of
    # the backward. Not ZeRO-3's: its bucket is still held around the optimizer step, and walking its optimizer
    # while its backward hooks partition gradients aborted a rank (std::terminate) in one CI run of the suite.
    first = next((p for p in engine.module.parameters() if p.requires_grad), None)
    if first is None or engine.zero_optimization_stage() == 3:
        return []
    return [first.register_hook(lambda grad: probe.snapshot(("buffers",)))]


def memory_now_bytes(device: torch.device) -> int:
    """CUDA: the bytes allocated now; CPU: the process's resident set now. Taken before the first step, it is the
    baseline the steps' peak grows from (the interpreter, libraries, model and optimizer states; on CPU also what
    the allocator kept of earlier variants)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return psutil.Process().memory_info().rss


def peak_reserved_bytes(device: torch.device) -> int | None:
    """CUDA: the most the caching allocator reserved (allocated plus cached and fragmented blocks), what the
    device really had to provide; None on CPU."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({cpu_model()})"


# ------------------------------------------------------------------------------------------ one variant
def _close_logs(run) -> None:
    """setup_logging adds a file handler to DeepSpeed's logger per build; the next variant adds its own."""
    for handler in list(run.log.handlers):
        if isinstance(handler, logging.FileHandler):
            deepspeed.utils.logger.removeHandler(handler)
            handler.close()


def free_memory() -> None:
    """Once a variant's run is unreachable: collect it (the instrumented engine sits in reference cycles) and
    hand its cached GPU memory back, before the next variant is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release(run) -> None:
    """End a variant's run for good. destroy() removes the gradient hooks DeepSpeed registers on the parameters:
    autograd keeps those (and through them the engine, its model and optimizer) alive where gc cannot see, so
    without it every variant's model would stay allocated and inflate the next one's peak memory."""
    _close_logs(run)
    run.engine.destroy()


def measure(args: argparse.Namespace, world: int, global_batch_size: int) -> dict:
    """One variant's report; its run is destroyed before returning, whether it ran through or raised."""
    sets = args.set + [f"train.global_batch_size={global_batch_size}"]
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, sets, world)
    run = build_run(cfg, ds)
    try:
        return _measure(run, cfg, ds, args.warmup, args.steps)
    finally:
        release(run)
        del run  # a raised exception's traceback keeps this frame, and with it the run, alive
        free_memory()


def _measure(run, cfg, ds: dict, warmup: int, timed: int) -> dict:
    engine = run.engine
    start_lr_schedule(engine)
    clock, probe = PhaseClock(engine.device), StateProbe(engine)
    hooks = instrument(engine, clock, probe)
    try:
        return _steps(run, cfg, ds, clock, probe, warmup, timed)
    finally:
        for hook in hooks:  # they reference the engine: the next variant must not keep it alive
            hook.remove()


def _steps(run, cfg, ds: dict, clock: PhaseClock, probe: StateProbe, warmup: int, timed: int) -> dict:
    engine = run.engine
    batches = micro_batches(run.dataset, run.sampler())
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    # On CPU peak RSS never shrinks: what the steps themselves add (their activations) is the peak over this.
    memory_before, peak_before = memory_now_bytes(engine.device), peak_memory_bytes(engine.device)
    steps = []
    total = warmup + timed + 1
    saved = SavedActivations(engine.module.parameters())
    for i in range(total):
        probe.armed = i == total - 1  # the last step is measured, not timed
        clock.reset()
        start = time.perf_counter()
        with saved if probe.armed else contextlib.nullcontext():
            loss = train_step(run, next(batches))
        steps.append({"loss": loss, "seconds": time.perf_counter() - start, **clock.seconds, "span": clock.span,
                      "first": clock.first, "last": clock.last, "instructions": clock.instructions,
                      "timed": warmup <= i < total - 1})
    params = [p for p in engine.module.parameters() if p.requires_grad]
    return {
        "rank": run.rank, "stage_id": int(getattr(engine, "stage_id", 0)), "dp_rank": run.dp_rank,
        "host": socket.gethostname(), "pipeline_schedule": cfg.parallel.pipeline_schedule,
        "device": device_name(engine.device), "steps": steps, "held": probe.peak,
        "optimizer_device": probe.optimizer_device, "peak_memory": peak_memory_bytes(engine.device),
        # The most activation bytes (autograd's saved tensors) held at once during the measured step.
        "peak_activations": saved.peak,
        "peak_reserved": peak_reserved_bytes(engine.device),
        "memory_before_steps": memory_before, "peak_memory_before_steps": peak_before,
        # Optimizer steps fp16's loss scaler skipped on overflow (0 under bf16 and fp32).
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
        # ZeRO-3 leaves partitioned parameters empty; ds_numel is their full size.
        "param_numels": [int(getattr(p, "ds_numel", p.numel())) for p in params],
        # DeepSpeed's Muon: the engine's tags, and the shapes its Muon group is sorted by.
        "param_muon": [bool(getattr(p, "use_muon", False)) for p in params] if is_muon(ds) else None,
        "param_shapes": [list(layer_shape(p)) for p in params],
        "optimizer_type": (ds.get("optimizer") or {}).get("type", "none"),
        "param_element_size": params[0].element_size() if params else 0,
        "world": run.world, "dp_size": run.dp_size, "grad_accum": run.grad_accum,
        "micro_batch_size": cfg.train.micro_batch_size, "global_batch_size": cfg.train.global_batch_size,
        "seq_len": cfg.data.seq_len, "flops_per_token": flops_per_token(run.model_config, cfg.data.seq_len),
        "peak_tflops": peak_tflops(engine.device, cfg.train.peak_tflops),
        "zero_stage": zero_stage(ds), "precision": precision(ds), "pipeline_stages": cfg.parallel.pipeline_stages,
        "tensor_parallel": cfg.parallel.tensor_parallel, "sequence_parallel": cfg.parallel.sequence_parallel,
        "tiled_mlp": cfg.train.tiled_mlp,
        "model": cfg.model.preset or cfg.model.path, "threads": torch.get_num_threads(),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="One benchmark rank (started by `deepspeed --module`).")
    add_run_args(p)
    p.add_argument("--global-batch-sizes", required=True, type=lambda s: [int(x) for x in s.split(",")],
                   help="comma-separated; the run is built and measured once per size")
    add_timing_args(p)
    return p.parse_args(argv)


def add_timing_args(p: argparse.ArgumentParser) -> None:
    """The flags every benchmark rank takes: steps untimed and timed, the result file, DeepSpeed's --local_rank."""
    p.add_argument("--warmup", type=int, required=True, help="untimed optimizer steps first")
    p.add_argument("--steps", type=int, required=True, help="timed optimizer steps")
    p.add_argument("--result", required=True, help="JSON file rank 0 writes")
    add_local_rank(p)


def write_result(path: str, variants: list) -> int:
    """Rank 0 writes the measured variants; every rank then leaves the process group. The exit status."""
    if dist.get_rank() == 0:
        write_json_atomic(Path(path), {"variants": variants})
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    reports = []
    for gbs in args.global_batch_sizes:
        reports.append(measure(args, world, gbs))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, reports)
    return write_result(args.result, [[gathered[r][v] for r in range(world)] for v in range(len(reports))])


if __name__ == "__main__":
    sys.exit(main())
