"""The seam's second module (utils/private_api.py holds the first, and the table of every private name both use):
DeepSpeed's pipeline engine extended with schedules of our own, and torch's split backward, which
parallel/zero_bubble.py runs on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch.distributed.pipelining import _backward as pipelining_backward


class PipelineEngineExtension(PipelineEngine):
    """DeepSpeed's PipelineEngine with its private extension points under public names, for an engine of our own
    schedule: `train_schedule()`, `extra_instructions` (instruction class -> method, added to DeepSpeed's table),
    `around_schedule()`, `output_grad(grad)` (the last stage's output gradient as DeepSpeed scales it), and
    `whole_backward` / `backward_running` to reuse DeepSpeed's backward."""

    extra_instructions: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, **cls.extra_instructions}

    def train_schedule(self):
        return PipelineEngine._train_schedule(self)

    def around_schedule(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def output_grad(self, grad):
        return PipelineEngine._backward_prologue_per_tensor(self, grad)

    def whole_backward(self, buffer_id: int) -> None:
        self._exec_backward_pass(buffer_id)

    @contextlib.contextmanager
    def backward_running(self) -> Iterator[None]:
        self._running_engine_backward = True
        try:
            yield
        finally:
            self._running_engine_backward = False

    def _train_schedule(self):
        return self.train_schedule()

    def _exec_schedule(self, pipe_schedule):
        with self.around_schedule():
            super()._exec_schedule(pipe_schedule)

    def _backward_prologue_per_tensor(self, grad):
        return self.output_grad(grad)


def backward_input(outputs: list, output_grads: list | None, inputs: list, weights: list) -> list[dict]:
    """The input half of a stage's backward (sets each input's .grad); returns what the weight half needs."""
    return pipelining_backward.stage_backward_input(outputs, output_grads, inputs, iter(weights))[1]


def backward_weight(weights: list, groups: list[dict]) -> None:
    """The weight half: accumulates into each weight's .grad."""
    pipelining_backward.stage_backward_weight(iter(weights), groups)


@contextlib.contextmanager
def pipeline_sends_in_background(sends: list) -> Iterator[None]:
    """Inside: DeepSpeed's pipeline sends start without waiting for their receiver; each (work, tensor) is appended
    to `sends` (the tensor kept alive until the caller waits), and those already done are dropped as new ones
    start. DeepSpeed's p2p.send refuses async_op, so its send is replaced for the duration."""
    blocking = p2p.send

    def start(tensor, dest_stage, async_op=False):
        sends[:] = [(work, kept) for work, kept in sends if not work.is_completed()]
        sends.append((torch.distributed.isend(tensor, p2p._grid.stage_to_global(stage_id=dest_stage)), tensor))

    p2p.send = start
    try:
        yield
    finally:
        p2p.send = blocking
