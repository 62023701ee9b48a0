"""Each pipeline schedule's bubble (parallel.pipeline_schedule: 1f1b, zb-h1, dualpipev) as the idle share of the p
ranks' time in the pipelined window, 1 - Σ compute / (p x window), the share `bench pipeline` measures; and how
many micro-batches' activations each rank holds at its peak. F is a forward, B a backward, I and W the input and
weight halves of a backward (B = I + W), all per micro-batch and stage; communication is free.

1F1B (DeepSpeed's TrainSchedule): bubble time (p-1)(F+B) in a window of m(F+B) + (p-1)(F+B), so the share is
(p-1)/(m+p-1) whatever F and B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", 2021).

ZB-H1 (parallel/zero_bubble.py): the zero-bubble paper (Qi et al., "Zero Bubble Pipeline Parallelism", 2024)
gives bubble time (p-1)(F+B-2W) = (p-1)(F+I-W), for W <= I and F >= I. What runs has (p-1) max(F+I-W, I, F):
with W > I the last stage's trailing weight halves end after the first stage, and with I > F a stage's input half
waits on the next stage's. In a window of m(F+I+W) plus that; at F = I = W the share is (p-1)/(3m+p-1). (The
engine's first stage runs its whole backward as I, W empty: its inputs take no gradient. That is the first stage's
own work at the end, and does not change the bubble.)

DualPipeV (DeepSpeed 0.19.8's DualPipeVSchedule): each rank holds two half stages, r and 2p-1-r; F and B are per
half stage, each rank computes 2m(F+B). DeepSeek's DualPipe README gives DualPipeV's bubble as
(PP/2-1)(F&B+B-3W) with PP = 2p half stages, F&B a forward overlapped with a backward, W deferred. DeepSpeed's
runs neither: a forward and a backward run one after the other and every backward keeps its weight half, and its
sends and receives wait for one another in batches (CommitP2P), so a forward's activations leave only after the
backward batched with it. What runs (simulate() on the real instruction streams) has bubble time
max((p-1)(F+2B) - F, (p-1)(2F+B), (2p-1)F + (p-2)B) (p >= 2): at B = 2F that is the first, (5p-6)F, the
README's bound with F&B = F+B and W = 0 less one forward, and the share is (5p-6)/(6m+5p-6).

Activations (micro-batches a rank holds at its peak): 1F1B stage r min(p-r, m); ZB-H1 p on every stage (m >= p):
p-r between a forward and its input half, the rest waiting for their weight half, which keeps the forward's graph
(torch's stage_backward_input retains it) so those count whole; DualPipeV rank r 2p-r half-stage micro-batches of
stage r and r+1 of stage 2p-1-r, 2p+1 half stages in all, the README's PP+1. Each is the maximum over the real
schedule's order (tests/test_plan_schedules.py walks DeepSpeed's and ours)."""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds_schedule

from .zero_bubble import BackwardInput, BackwardWeight, ZeroBubbleSchedule

# The plan's assumption: a transformer layer's input half of the backward costs its forward, and so does its weight
# half (both are one matmul per forward matmul).
F_I_W = (1.0, 1.0, 1.0)


def bubble(schedule: str, p: int, m: int, f: float = F_I_W[0], i: float = F_I_W[1], w: float = F_I_W[2]) -> float:
    """The closed forms above: `f`, `i`, `w` per micro-batch and stage (DualPipeV: of a whole stage, two half
    stages; 1F1B: B = i + w)."""
    if p == 1:
        return 0.0
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    if schedule == "zb-h1":
        idle = (p - 1) * max(f + i - w, i, f)
        return idle / (m * (f + i + w) + idle)
    if schedule == "dualpipev":
        f, b = f / 2, (i + w) / 2  # per half stage
        idle = max((p - 1) * (f + 2 * b) - f, (p - 1) * (2 * f + b), (2 * p - 1) * f + (p - 2) * b)
        return idle / (2 * m * (f + b) + idle)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def parts(schedule: str, p: int, rank: int) -> list[int]:
    """The model parts pipeline rank `rank` holds: its stage, or DualPipeV's two half stages."""
    return [rank, 2 * p - 1 - rank] if schedule == "dualpipev" and p > 1 else [rank]


def in_flight(schedule: str, p: int, stage: int, m: int) -> list[tuple[int, int]]:
    """(stage, micro-batches) whose activations pipeline rank `stage` holds at its peak: one stage, or DualPipeV's
    two half stages."""
    if p == 1:
        return [(0, 1)]
    if schedule == "zb-h1":
        return [(stage, p)]
    if schedule == "dualpipev":
        return [(stage, 2 * p - stage), (2 * p - 1 - stage, stage + 1)]
    return [(stage, min(p - stage, m))]


# ------------------------------------------------------------------------------ the schedules as they run
_TRAIN = {"1f1b": ds_schedule.TrainSchedule, "zb-h1": ZeroBubbleSchedule, "dualpipev": ds_schedule.DualPipeVSchedule}
_COMPUTE = {ds_schedule.ForwardPass: "F", ds_schedule.BackwardPass: "B", BackwardInput: "B", BackwardWeight: "W"}
_MESSAGES = {ds_schedule.SendActivation: ("act", 1, "send"), ds_schedule.RecvActivation: ("act", 0, "recv"),
             ds_schedule.SendGrad: ("grad", -1, "send"), ds_schedule.RecvGrad: ("grad", 0, "recv")}


def _stream(schedule: str, p: int, rank: int, m: int) -> list[tuple]:
    """Rank `rank`'s instructions: ("F" | "B" | "W", stage), ("send" | "recv", message), ("commit",). A message is
    (act | grad, the stage it goes to, micro-batch): each stage sends and receives its micro-batches in order."""
    count: dict[tuple, int] = {}
    out = []
    for cmds in _TRAIN[schedule](micro_batches=m, stages=p, stage_id=rank).steps():
        for c in cmds:
            stage = rank if getattr(c, "phase", 0) == 0 else 2 * p - 1 - rank
            if type(c) in _COMPUTE:
                out.append((_COMPUTE[type(c)], stage))
            elif type(c) in _MESSAGES:
                what, shift, side = _MESSAGES[type(c)]
                nth = count.setdefault((type(c), stage), 0)
                count[(type(c), stage)] = nth + 1
                out.append((side, (what, stage + shift, nth)))
            elif isinstance(c, ds_schedule.CommitP2P):
                out.append(("commit",))
    return out


def simulate(schedule: str, p: int, m: int, times: dict[int, dict[str, float]]) -> float:
    """The bubble of `schedule` as its instruction streams run with each stage's compute times (`times`: stage ->
    {"F", "B", "W"} seconds per micro-batch; B is zb-h1's input half; DualPipeV's stages are its 2p half stages)
    and free communication: a receive waits for its send; DualPipeV's batched sends and receives (CommitP2P) wait
    for the peer's batch to start, as gloo's and NCCL's point-to-point operations wait for their partner."""
    streams = [_stream(schedule, p, r, m) for r in range(p)]
    clock, pos, busy = [0.0] * p, [0] * p, [0.0] * p
    first: list[float | None] = [None] * p
    end = [0.0] * p
    sent: dict[tuple, float] = {}
    posted: dict[tuple, float] = {}
    queued: list[list] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(streams[r]):
                op = streams[r][pos[r]]
                if op[0] in ("F", "B", "W"):
                    seconds = times[op[1]][op[0]]
                    first[r] = clock[r] if first[r] is None else first[r]
                    clock[r] += seconds
                    busy[r] += seconds
                    end[r] = clock[r]
                elif op[0] in ("send", "recv") and schedule == "dualpipev":
                    queued[r].append(op)
                elif op[0] == "send":
                    sent[op[1]] = clock[r]
                elif op[0] == "recv":
                    if op[1] not in sent:
                        break
                    clock[r] = max(clock[r], sent[op[1]])
                else:
                    for side, message in queued[r]:
                        posted.setdefault((message, side), clock[r])
                    peers = [posted.get((message, "recv" if side == "send" else "send")) for side, message in queued[r]]
                    if None in peers:
                        break
                    clock[r] = max([clock[r], *peers])
                    queued[r] = []
                pos[r] += 1
                progress = True
    if pos != [len(s) for s in streams]:
        raise RuntimeError(f"{schedule} at p={p}, m={m}: the simulated schedule deadlocked")
    return 1 - sum(busy) / (p * (max(end) - min(f for f in first if f is not None)))
