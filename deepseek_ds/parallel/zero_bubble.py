"""parallel.pipeline_schedule zb-h1: the zero-bubble schedule ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
2024) on DeepSpeed's PipelineEngine. Each backward is split into its input half I (the gradient the previous stage
waits for) and its weight half W, and W runs later, where 1F1B leaves the stage idle: the bubble shrinks from
(p-1)(F+B) to (p-1)(F+B-2W) at 1F1B's activation memory.

Written here because DeepSpeed has one training schedule (1F1B) and no split backward, and torch's
ScheduleInterleavedZeroBubble runs torch's own PipelineStage, not DeepSpeed's engine: the order is torch's ZB1P with
one stage per rank (tests/test_pipeline_schedules.py compares them), the split itself is torch's
(stage_backward_input / stage_backward_weight, through utils/private_api.py), and the engine is DeepSpeed's
PipelineEngine with two more instructions, as DeepSpeed's own DualPipeVEngine extends it."""

from __future__ import annotations

import contextlib
from collections import deque

import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch.utils.checkpoint import checkpoint

from ..utils.private_pipeline import (
    PipelineEngineExtension,
    backward_input,
    backward_weight,
    pipeline_sends_in_background,
)


def zb_h1_order(stages: int, stage_id: int, micro_batches: int) -> list[tuple[str, int]]:
    """The compute operations of pipeline rank `stage_id`, in order: ("F", mb) forward, ("I", mb) the input half of
    its backward, ("W", mb) the weight half. Rank r runs p - r forwards ahead (1F1B: p - r - 1; an I is shorter than
    a whole backward, so one more fits) and runs each W r operations after its I."""
    warmup = min(stages - stage_id, micro_batches)
    ops = [("F", mb) for mb in range(warmup)]
    for mb in range(micro_batches):
        ops.append(("I", mb))
        if mb >= stage_id:
            ops.append(("W", mb - stage_id))
        if warmup + mb < micro_batches:
            ops.append(("F", warmup + mb))
    return ops + [("W", mb) for mb in range(max(0, micro_batches - stage_id), micro_batches)]


class BackwardInput(schedule.BufferOpInstruction):
    """The input half of a backward pass: the gradient of the stage's inputs, sent upstream next; the pieces the
    weight half needs are queued."""


class BackwardWeight(schedule.PipeInstruction):
    """The weight half of the oldest queued backward pass (micro-batch `micro_batch`): accumulates the gradients of
    the stage's parameters."""


class ZeroBubbleSchedule(schedule.PipeSchedule):
    """ZB-H1 as DeepSpeed instructions: each receive right before the operation that needs it, each send right after
    the one that made it (sends do not wait for their receiver: ZeroBubbleEngine)."""

    def num_pipe_buffers(self) -> int:
        # Micro-batches in flight between a forward and its input backward: the p - r forwards run ahead.
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def steps(self):
        first, last = self.is_first_stage, self.is_last_stage
        for op, mb in zb_h1_order(self.stages, self.stage_id, self.micro_batches):
            buffer = mb % self.num_pipe_buffers()
            if op == "F":
                cmds = [] if first else [schedule.RecvActivation(buffer)]
                cmds += [schedule.LoadMicroBatch(buffer)] if first or last else []
                cmds += [schedule.ForwardPass(buffer)] + ([] if last else [schedule.SendActivation(buffer)])
            elif op == "I":
                cmds = [] if last else [schedule.RecvGrad(buffer)]
                cmds += [BackwardInput(buffer)] + ([] if first else [schedule.SendGrad(buffer)])
            else:
                cmds = [BackwardWeight(micro_batch=mb)]
            yield cmds
        yield [schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()]


def _checkpoint(function, *args):
    return checkpoint(function, *args, use_reentrant=False)


def _floating(tensors) -> list[torch.Tensor]:
    return [t for t in ((tensors,) if torch.is_tensor(tensors) else tensors) if t.is_floating_point()]


class ZeroBubbleEngine(PipelineEngineExtension):
    """DeepSpeed's PipelineEngine running ZeroBubbleSchedule. deepspeed.initialize builds a PipelineEngine (it picks
    the class itself); `adopt` turns that engine into this one."""

    @classmethod
    def adopt(cls, engine: PipelineEngine) -> ZeroBubbleEngine:
        engine.__class__ = cls
        # DeepSpeed's checkpoints (reentrant or not) refuse torch.autograd.grad, which the input half is: torch's
        # non-reentrant one allows it and gives the same gradients.
        engine.module.activation_checkpoint_func = _checkpoint
        engine.weights = [p for p in engine.module.parameters() if p.requires_grad]  # fixed once the engine is built
        engine.weight_halves = deque()  # each input half's parameter groups (torch's), oldest first
        engine.sends = []
        return engine

    def train_schedule(self):
        return ZeroBubbleSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    @contextlib.contextmanager
    def around_schedule(self):
        # A send that waited for its receiver would deadlock: stage r sends the activations of its (p-r)th forward
        # while stage r+1 sends the gradient of its first input backward. Each send is started and kept until done.
        with pipeline_sends_in_background(self.sends):
            yield
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()

    def input_half(self, buffer_id: int) -> None:
        if self.is_first_stage():
            # Its inputs (token ids) take no gradient, so there is no input half to send early: the whole backward
            # runs here (torch's ZB1P runs the first stage's W right after its I too).
            self.whole_backward(buffer_id)
            self.weight_halves.append([])
            return
        if self.is_last_stage():
            # Scaled as DeepSpeed's engine.backward scales it (by the accumulation steps, and fp16's loss scale).
            outputs, output_grads = [self.optimizer.scale_if_loss(self.loss / self.gradient_accumulation_steps())], None
        else:
            # Copies: DeepSpeed receives every micro-batch's gradient into one buffer, and the weight half keeps
            # the gradients at its nodes, which a residual add passes on as that very tensor.
            outputs = _floating(self.pipe_buffers["outputs"][buffer_id])
            output_grads = [g.clone() for g in _floating(self.grad_layer)]
        inputs = [t for t in _floating(self.pipe_buffers["inputs"][buffer_id]) if t.requires_grad]
        with self.backward_running():
            self.weight_halves.append(backward_input(outputs, output_grads, inputs, self.weights))
        self.pipe_buffers["outputs"][buffer_id] = None

    def weight_half(self, micro_batch: int) -> None:
        groups = self.weight_halves.popleft()
        if not groups:
            return
        with self.backward_running():
            backward_weight(self.weights, groups)
        # After every backward ZeRO 1 moves .grad into its accumulation buffer when that has another dtype: the
        # weight half's gradients arrive after the input half's backward ended.
        self.optimizer.backward_epilogue()

    def output_grad(self, grad):
        # DeepSpeed's hook on the last stage's outputs divides their gradient by the accumulation steps, for a
        # backward the user started from an unscaled loss. The input half starts from a scaled one, and the weight
        # half runs the outputs' nodes again: the hook would divide a second and a third time.
        return grad

    extra_instructions = {BackwardInput: input_half, BackwardWeight: weight_half}
