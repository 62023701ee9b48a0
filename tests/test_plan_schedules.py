"""parallel/schedule_model.py against the schedules' real instruction streams (DeepSpeed's TrainSchedule and
DualPipeVSchedule, our ZeroBubbleSchedule): the micro-batches each rank holds, counted here by walking the streams,
and the bubble formulas, against the published closed forms and the streams run with given operation times."""

import random

import pytest
from deepspeed.runtime.pipe import schedule as ds

from deepseek_ds.parallel import schedule_model as ps
from deepseek_ds.parallel.schedule_rules import min_micro_batches
from deepseek_ds.parallel.zero_bubble import BackwardInput, BackwardWeight, ZeroBubbleSchedule

STREAMS = {"1f1b": ds.TrainSchedule, "zb-h1": ZeroBubbleSchedule, "dualpipev": ds.DualPipeVSchedule}


def held_over_time(schedule, p, rank, m):
    """Micro-batches whose activations each model part of `rank` holds, after every instruction: a forward adds
    one; a backward releases it, except zb-h1's input half past the first stage (the weight half keeps the graph,
    torch's stage_backward_input retaining it) whose weight half releases it."""
    held, out = {}, []
    for cmds in STREAMS[schedule](micro_batches=m, stages=p, stage_id=rank).steps():
        for c in cmds:
            part = rank if getattr(c, "phase", 0) == 0 else 2 * p - 1 - rank
            if isinstance(c, ds.ForwardPass):
                held[part] = held.get(part, 0) + 1
            elif isinstance(c, ds.BackwardPass) or (isinstance(c, BackwardInput) and rank == 0):
                held[part] -= 1
            elif isinstance(c, BackwardWeight) and rank > 0:
                held[part] -= 1
            else:
                continue
            out.append(dict(held))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "dualpipev"])
def test_in_flight_is_the_peak_of_the_real_order(schedule):
    rng = random.Random(0)
    for p in (2, 3, 4, 6):
        for m in sorted({min_micro_batches(schedule, p), 2 * p, 2 * p + 1, 5 * p, 1, 2}):
            if m < min_micro_batches(schedule, p):
                continue
            for rank in range(p):
                timeline = held_over_time(schedule, p, rank, m)
                model = dict(ps.in_flight(schedule, p, rank, m))
                assert sorted(model) == sorted(ps.parts(schedule, p, rank)) == sorted(timeline[-1])
                # The peak in bytes, whatever each part's bytes per micro-batch: the model's counts are all reached
                # at once and never exceeded.
                for _ in range(5):
                    size = {part: rng.uniform(0.1, 10) for part in model}
                    peak = max(sum(size[k] * n for k, n in held.items()) for held in timeline)
                    assert peak == pytest.approx(sum(size[k] * n for k, n in model.items())), (p, m, rank)


@pytest.mark.unit
def test_in_flight_against_the_published_counts():
    # 1F1B: stage r holds p - r (Narayanan et al. 2021); ZB-H1: 1F1B's peak, p (Qi et al. 2024); DualPipeV: PP + 1
    # half stages, PP = 2p (DualPipe's README).
    assert [ps.in_flight("1f1b", 4, r, 8) for r in range(4)] == [[(0, 4)], [(1, 3)], [(2, 2)], [(3, 1)]]
    assert [ps.in_flight("1f1b", 4, r, 2) for r in range(4)] == [[(0, 2)], [(1, 2)], [(2, 2)], [(3, 1)]]
    assert {n for r in range(4) for _, n in ps.in_flight("zb-h1", 4, r, 8)} == {4}
    assert {sum(n for _, n in ps.in_flight("dualpipev", 4, r, 8)) for r in range(4)} == {2 * 4 + 1}
    assert ps.in_flight("dualpipev", 4, 1, 8) == [(1, 7), (6, 2)]


def uniform(schedule, p, f, i, w):
    """Every stage's times, as the engines run them: zb-h1's first stage runs its whole backward as the input half,
    DualPipeV's half stages take half a stage's times and keep the weight gradient in the backward."""
    if schedule == "dualpipev":
        return {part: {"F": f / 2, "B": (i + w) / 2, "W": 0.0} for part in range(2 * p)}
    if schedule == "zb-h1":
        return {part: {"F": f, "B": i + w if part == 0 else i, "W": 0.0 if part == 0 else w} for part in range(p)}
    return {part: {"F": f, "B": i + w, "W": 0.0} for part in range(p)}


@pytest.mark.unit
def test_simulated_orders_give_the_published_bubbles():
    for p, m in ((2, 4), (2, 8), (4, 8), (4, 16), (3, 7)):
        # 1F1B: (p-1)/(m+p-1) whatever F and B.
        for f, b in ((1, 2), (1, 1), (2, 1)):
            assert ps.simulate("1f1b", p, m, uniform("1f1b", p, f, b, 0)) == pytest.approx((p - 1) / (m + p - 1))
        # ZB-H1: bubble time (p-1)(F+B-2W) with B = I + W, where W <= I <= F (the paper's setting).
        for f, i, w in ((1, 1, 1), (1, 0.8, 0.5), (2, 1.5, 1)):
            idle = (p - 1) * (f + i + w - 2 * w)
            assert ps.simulate("zb-h1", p, m, uniform("zb-h1", p, f, i, w)) == pytest.approx(
                idle / (m * (f + i + w) + idle))


@pytest.mark.unit
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "dualpipev"])
def test_bubble_formula_is_the_real_order_at_equal_stages(schedule):
    rng = random.Random(1)
    for _ in range(60):
        p = rng.choice([1, 2, 3, 4, 5])
        m = min_micro_batches(schedule, p) + rng.choice([0, 1, p, 3 * p])
        f, i, w = (rng.uniform(0.2, 3) for _ in range(3))
        assert ps.bubble(schedule, p, m, f, i, w) == pytest.approx(
            ps.simulate(schedule, p, m, uniform(schedule, p, f, i, w)), abs=1e-12), (p, m, f, i, w)


@pytest.mark.unit
def test_plan_bubbles_at_equal_forward_input_and_weight_times():
    assert ps.bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert ps.bubble("zb-h1", 4, 8) == pytest.approx(3 / 27)  # (p-1)/(3m+p-1)
    assert ps.bubble("dualpipev", 4, 8) == pytest.approx(14 / 62)  # (5p-6)/(6m+5p-6)
    assert ps.bubble("dualpipev", 1, 2) == ps.bubble("zb-h1", 1, 1) == 0
