"""parallel.pipeline_schedule: each schedule's operation order against torch.distributed.pipelining's for the same p
and m, ZB-H1's instruction stream run on a model of the pipeline (every receive gets the micro-batch its buffer
expects, nothing deadlocks), and the refusals. The training runs themselves are in test_equivalence.py's launches
(pp2/pp4-zbh1, pp2/pp4-dualpipev against the single-process reference and against 1f1b)."""

from collections import deque
from unittest import mock

import pytest
from deepspeed.runtime.pipe import schedule as ds_schedule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

from deepseek_ds.config import ConfigError, load_and_validate
from deepseek_ds.parallel.zero_bubble import BackwardInput, BackwardWeight, ZeroBubbleSchedule, zb_h1_order

pytestmark = pytest.mark.unit

_TORCH_KIND = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}


def _kind(action) -> str:
    return _TORCH_KIND[str(action.computation_type).split(".")[-1]]


def torch_zb1p(p: int, m: int) -> dict[int, list[tuple[str, int]]]:
    """torch's ZB1P (ScheduleInterleavedZeroBubble) with one stage per rank, which is ZB-H1: its visualizer
    helper takes 2+ stages per rank only, so the schedule is built on a stand-in stage as the helper builds it."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p
    order = ScheduleInterleavedZeroBubble([stage], m).pipeline_order
    return {r: [(_kind(a), a.microbatch_index) for a in order[r] if a is not None] for r in range(p)}


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 6), (3, 9), (4, 4), (4, 8), (4, 12)])
def test_zb_h1_order_equals_torchs(p, m):
    reference = torch_zb1p(p, m)
    for r in range(p):
        assert zb_h1_order(p, r, m) == reference[r], f"stage {r} of {p}, {m} micro-batches"


def _run_pipeline(p: int, m: int) -> dict[int, list[tuple[str, int]]]:
    """Every stage's ZeroBubbleSchedule executed on a model of DeepSpeed's pipeline: buffers hold micro-batch ids,
    sends never wait (ZeroBubbleEngine starts them in the background), a receive waits until its message arrives.
    Returns each stage's compute operations in the order they ran."""
    streams = {r: [c for step in ZeroBubbleSchedule(m, p, r).steps() for c in step] for r in range(p)}
    buffers = {r: {} for r in range(p)}
    pending_w = {r: deque() for r in range(p)}
    acts = {r: deque() for r in range(p)}   # messages to stage r from r-1
    grads = {r: deque() for r in range(p)}  # messages to stage r from r+1
    loaded, done = {r: 0 for r in range(p)}, {r: [] for r in range(p)}
    pos = {r: 0 for r in range(p)}
    while any(pos[r] < len(streams[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(streams[r]):
                cmd = streams[r][pos[r]]
                buf = cmd.kwargs.get("buffer_id")
                if isinstance(cmd, ds_schedule.RecvActivation):
                    if not acts[r]:
                        break
                    assert buf not in buffers[r], f"stage {r} receives into buffer {buf}, still in flight"
                    buffers[r][buf] = acts[r].popleft()
                elif isinstance(cmd, ds_schedule.LoadMicroBatch):
                    if r == 0:
                        assert buf not in buffers[r], f"stage 0 loads into buffer {buf}, still in flight"
                        buffers[r][buf] = loaded[r]
                    else:  # the last stage loads the labels of the micro-batch it received
                        assert buffers[r][buf] == loaded[r]
                    loaded[r] += 1
                elif isinstance(cmd, ds_schedule.ForwardPass):
                    done[r].append(("F", buffers[r][buf]))
                elif isinstance(cmd, ds_schedule.SendActivation):
                    acts[r + 1].append(buffers[r][buf])
                elif isinstance(cmd, ds_schedule.RecvGrad):
                    if not grads[r]:
                        break
                    assert grads[r].popleft() == buffers[r][buf], f"stage {r} got another micro-batch's gradient"
                elif isinstance(cmd, BackwardInput):
                    mb = buffers[r][buf]
                    done[r].append(("I", mb))
                    pending_w[r].append(mb)
                    if r == 0:
                        del buffers[r][buf]
                elif isinstance(cmd, ds_schedule.SendGrad):
                    grads[r - 1].append(buffers[r].pop(buf))
                elif isinstance(cmd, BackwardWeight):
                    assert pending_w[r].popleft() == cmd.kwargs["micro_batch"]
                    done[r].append(("W", cmd.kwargs["micro_batch"]))
                pos[r] += 1
                progressed = True
        waiting = [streams[r][pos[r]] for r in range(p) if pos[r] < len(streams[r])]
        assert progressed, f"deadlock: stages wait at {waiting}"
    assert all(not buffers[r] and not pending_w[r] and loaded[r] == (m if r in (0, p - 1) else 0) for r in range(p))
    return done


@pytest.mark.parametrize("p,m", [(2, 8), (3, 9), (4, 4), (4, 8)])
def test_zero_bubble_instructions_run_torchs_order_without_deadlock(p, m):
    reference = torch_zb1p(p, m)
    ran = _run_pipeline(p, m)
    for r in range(p):
        assert ran[r] == reference[r], f"stage {r} of {p}, {m} micro-batches"


def _dualpipev_deepspeed(p: int, r: int, m: int) -> list[tuple[str, int, int]]:
    ops = []
    for step in ds_schedule.DualPipeVSchedule(micro_batches=m, stages=p, stage_id=r).steps():
        for c in step:
            if isinstance(c, (ds_schedule.ForwardPass, ds_schedule.BackwardPass)):
                phase = c.kwargs["phase"]
                ops.append(("F" if isinstance(c, ds_schedule.ForwardPass) else "B", phase,
                            c.kwargs["buffer_id"] - phase * m))
    return ops


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_dualpipev_order_equals_torchs(p, m):
    """DeepSpeed's DualPipeVSchedule (what dualpipev runs) against torch's ScheduleDualPipeV: the same forwards and
    backwards of the same (phase, micro-batch) in the same order on every rank. DeepSpeed keeps each weight half
    inside its backward, so torch's I counts as the backward and its W is left out; an overlapped F;B pair is the F
    then the B, as DeepSpeed runs them."""
    torch_ops = get_schedule_ops("DualPipeV", p, m)
    for r in range(p):
        reference = []
        for action in (a for a in torch_ops[r] if a is not None):
            for sub in action.sub_actions or [action]:
                kind = _kind(sub)
                if kind != "W":
                    reference.append(("F" if kind == "F" else "B", 0 if sub.stage_index == r else 1,
                                      sub.microbatch_index))
        assert _dualpipev_deepspeed(p, r, m) == reference, f"rank {r} of {p}, {m} micro-batches"


@pytest.mark.parametrize("sets,ranks,ds_config,message", [
    (["parallel.pipeline_schedule=zb-h2"], 2, "ds_configs/zero1_pp.json",
     r"parallel.pipeline_schedule = 'zb-h2': use one of 1f1b, zb-h1, dualpipev"),
    (["parallel.pipeline_schedule=zb-h1"], 2, "ds_configs/zero1.json",
     r"pipeline_schedule = zb-h1 orders the passes of a pipeline, but parallel.pipeline_stages = 1"),
    (["parallel.pipeline_schedule=zb-h1", "parallel.pipeline_stages=4", "train.global_batch_size=24",
      "train.micro_batch_size=8"], 4, "ds_configs/zero1_pp.json", r"zb-h1 needs at least 4 micro-batches .* = 3"),
    (["parallel.pipeline_schedule=dualpipev", "parallel.pipeline_stages=2", "train.global_batch_size=24",
      "train.micro_batch_size=8"], 2, "ds_configs/zero1_pp.json", r"dualpipev needs at least 4 micro-batches"),
    (["parallel.pipeline_schedule=zb-h1", "parallel.pipeline_stages=2"], 2, "ds_configs/zero0.json",
     r"zb-h1 splits each backward .* ZeRO stage 0"),
])
def test_schedules_refuse_what_they_cannot_serve(sets, ranks, ds_config, message):
    with pytest.raises(ConfigError, match=message):
        load_and_validate("recipes/tiny-v3.yaml", ds_config, sets, ranks)
