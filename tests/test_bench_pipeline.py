"""`deepseek-ds bench pipeline`: the per-rank idle measure, the per-stage instruction times and the formulas they
feed, the saved-activation count, the refusals, and a real sweep of 1f1b at 1 and 2 stages and zb-h1 at 2 stages x
2 and 3 micro-batches (three launches) that writes every report file, with the same threads in every rank of every
row."""

import csv
import json
import os

import pytest
import torch

from deepseek_ds.bench.pipeline_bench import check_schedules, replica_bubble, schedule_bubbles, stage_times
from deepseek_ds.bench.saved_activations import SavedActivations
from deepseek_ds.config import ConfigError
from helpers import ROOT, cli, launch_env


@pytest.mark.unit
def test_measured_bubble_is_the_idle_share_of_the_window():
    def steps(*timed):  # (compute, span) per timed step, after one untimed warm-up step
        return {"steps": [{"compute": 0.0, "span": 9.0, "timed": False}]
                + [{"compute": c, "span": w, "timed": True} for c, w in timed]}

    # Two stages; stage 0's span is the window. Step 1: 2 + 1 busy of 2 x 3 -> 0.5; step 2: 2 + 2 of 2 x 2 -> 0.
    bubble, idle = replica_bubble([steps((2.0, 3.0), (2.0, 2.0)), steps((1.0, 1.0), (2.0, 2.0))])
    assert bubble == pytest.approx(0.25)  # median of 0.5 and 0
    assert idle == pytest.approx([(1 / 3 + 0) / 2, (2 / 3 + 0) / 2])


@pytest.mark.unit
def test_on_one_host_the_window_spans_every_rank():
    # zb-h1 with weight halves longer than input halves: the last stage ends after stage 0. Stage 0 computes 3 s in
    # [10, 14], stage 1 4 s in [11, 16]: the window is [10, 16], the bubble 1 - 7 / 12.
    def rank(compute, first, last):
        return {"host": "h", "steps": [{"compute": compute, "span": last - first, "first": first, "last": last,
                                        "timed": True}]}

    bubble, idle = replica_bubble([rank(3.0, 10.0, 14.0), rank(4.0, 11.0, 16.0)])
    assert bubble == pytest.approx(5 / 12) and idle == pytest.approx([1 / 2, 1 / 3])


def _reports(schedule, p, per_rank):
    """Ranks' reports with one timed step of the given {instruction: (seconds, calls)} and one untimed one."""
    return [{"stage_id": r, "steps": [{"timed": False, "instructions": {"ForwardPass": [99.0, 1]}},
                                      {"timed": True, "instructions": instructions}]}
            for r, instructions in enumerate(per_rank)]


@pytest.mark.unit
def test_stage_times_and_the_formulas_they_feed():
    # zb-h1, 2 stages x 4 micro-batches: stage 0's input half is its whole backward (2 s), stage 1 F 1, I 1, W 1.
    reports = _reports("zb-h1", 2, [{"ForwardPass": [4.0, 4], "BackwardInput": [8.0, 4], "BackwardWeight": [0.0, 4]},
                                    {"ForwardPass": [4.0, 4], "BackwardInput": [4.0, 4], "BackwardWeight": [4.0, 4]}])
    times = stage_times("zb-h1", 2, reports)
    assert times == {0: {"F": 1.0, "B": 2.0, "W": 0.0}, 1: {"F": 1.0, "B": 1.0, "W": 1.0}}
    # The paper's bubble time (p-1)(F+B-2W) = 1 over a window of m(F+B) + 1 = 13.
    formula, model = schedule_bubbles("zb-h1", 2, 4, times)
    assert formula == pytest.approx(1 / 13) and model == pytest.approx(1 / 13)
    # 1f1b: (p-1)/(m+p-1) whatever the times; DualPipeV: each rank's two half stages by phase.
    reports = _reports("1f1b", 2, [{"ForwardPass": [2.0, 2], "BackwardPass": [4.0, 2]}] * 2)
    assert schedule_bubbles("1f1b", 2, 2, stage_times("1f1b", 2, reports)) == pytest.approx((1 / 3, 1 / 3))
    reports = _reports("dualpipev", 2, [{"ForwardPass/0": [4.0, 4], "ForwardPass/1": [8.0, 4],
                                         "BackwardPass/0": [8.0, 4], "BackwardPass/1": [16.0, 4]},
                                        {"ForwardPass/0": [4.0, 4], "ForwardPass/1": [4.0, 4],
                                         "BackwardPass/0": [8.0, 4], "BackwardPass/1": [8.0, 4]}])
    times = stage_times("dualpipev", 2, reports)
    assert times == {0: {"F": 1.0, "B": 2.0, "W": 0.0}, 1: {"F": 1.0, "B": 2.0, "W": 0.0},
                     2: {"F": 1.0, "B": 2.0, "W": 0.0}, 3: {"F": 2.0, "B": 4.0, "W": 0.0}}


@pytest.mark.unit
def test_saved_activations_count_what_autograd_keeps():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with SavedActivations(net.parameters()) as saved:
        loss = net(x).sum()
        # The first linear keeps its input (5 x 8 fp32), ReLU its output, which the second linear keeps as its
        # input too (5 x 16, one storage); the weights are parameters.
        assert saved.now == 5 * 8 * 4 + 5 * 16 * 4
        loss.backward()
    assert saved.peak == 5 * 8 * 4 + 5 * 16 * 4 and saved.now == 0


@pytest.mark.unit
def test_schedules_that_cannot_run_are_refused_before_any_launch(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="unknown"):
        check_schedules(["1f1b", "gpipe"], [2], [4])
    with pytest.raises(ConfigError, match="dualpipev at 2 stages needs at least 4 micro-batches"):
        check_schedules(["dualpipev"], [1, 2], [4, 2])
    with pytest.raises(ConfigError, match="zb-h1 at 4 stages needs at least 4"):
        check_schedules(["1f1b", "zb-h1"], [2, 4], [2, 8])
    check_schedules(["1f1b", "zb-h1", "dualpipev"], [1, 2], [4, 8])  # p = 1 runs any m
    monkeypatch.chdir(ROOT)
    assert cli(["bench", "pipeline", "--config", "recipes/tiny-v3.yaml", "--schedules", "zb-h1", "--stages", "2",
                "--micro-batches", "1", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "raw").exists()


@pytest.mark.launch
def test_bench_pipeline_sweeps_and_writes_the_report(tmp_path, data_dir, monkeypatch):
    for key, value in launch_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the bench's own choice of threads is under test
    monkeypatch.chdir(ROOT)
    out = tmp_path / "pipeline"
    sets = [f"data.path={data_dir}", "data.seq_len=32", "train.micro_batch_size=2",
            "model.overrides.num_hidden_layers=2"]
    # --allow-busy: the test host is shared (test_bench_report refuses a busy one without it).
    assert cli(["bench", "pipeline", "--config", "recipes/tiny-v3.yaml", "--schedules", "1f1b,zb-h1",
                "--stages", "1,2", "--micro-batches", "2,3", "--steps", "2", "--warmup", "1", "--allow-busy",
                "--out", str(out)] + [a for s in sets for a in ("--set", s)]) == 0

    for name in ("pipeline.md", "pipeline.csv", "pipeline_stages.csv", "pipeline_throughput.png",
                 "pipeline_bubble.png"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "pipeline.md").read_text()
    assert "(p-1)/(m+p-1)" in md and "max(F+I-W, I, F)" in md and "## Environment" in md and "git commit" in md

    # Every rank of every row, the 1-stage rows' included, ran the threads chosen for the largest launch (2 ranks),
    # as each rank measured them: a 1-rank launch on all the cores is another machine (55x slower on a busy host).
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for name in ("pp1", "pp2", "pp2-zb-h1"):
        with open(out / "raw" / f"{name}.result.json") as f:
            variants = json.load(f)["variants"]
        assert {rank["threads"] for variant in variants for rank in variant} == {threads}, name
        # The engine's own instructions are timed, zb-h1's halves of the backward among them, and nothing else
        # counts as compute.
        timed = {"pp1": set(), "pp2": {"ForwardPass", "BackwardPass"},
                 "pp2-zb-h1": {"ForwardPass", "BackwardInput", "BackwardWeight"}}[name]
        for rank in (rank for variant in variants for rank in variant):
            for step in rank["steps"]:
                assert set(step["instructions"]) == timed
                if timed:
                    assert step["compute"] == pytest.approx(sum(t for t, _ in step["instructions"].values()))
    assert f"launched with {threads} torch thread(s)" in md
    assert f"**torch threads per rank (as the ranks measured them)**: {threads}\n" in md

    with open(out / "pipeline.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["schedule"], int(r["stages"]), int(r["micro_batches"])) for r in rows] == [
        ("1f1b", 1, 2), ("1f1b", 1, 3), ("1f1b", 2, 2), ("1f1b", 2, 3), ("zb-h1", 2, 2), ("zb-h1", 2, 3)]
    for r in rows:
        p, m = int(r["stages"]), int(r["micro_batches"])
        if r["schedule"] == "1f1b":
            assert float(r["bubble_formula"]) == pytest.approx((p - 1) / (m + p - 1))
        assert 0 <= float(r["bubble_measured"]) < 1 and float(r["tokens_per_s"]) > 0
        assert float(r["step_time_min_s"]) <= float(r["step_time_s"]) <= float(r["step_time_max_s"])
        assert int(r["global_batch_size"]) == 2 * int(r["micro_batches"])
        assert r["threads"] == str(threads)
        # Two timed steps: the median is their mean, between the slowest and the fastest.
        low, median, high = (float(r[k]) for k in ("tokens_per_s_min", "tokens_per_s", "tokens_per_s_max"))
        assert low <= median <= high and 1 / median == pytest.approx((1 / low + 1 / high) / 2)
    with open(out / "pipeline_stages.csv") as f:
        stages = list(csv.DictReader(f))
    assert len(stages) == 1 + 1 + 2 + 2 + 2 + 2
    # Two stages split the model's parameters between them: nothing lost, nothing duplicated (no tied weights).
    whole = {int(s["params"]) for s in stages if s["stages"] == "1"}
    split = {(schedule, m): sum(int(t["params"]) for t in stages
                                if t["stages"] == "2" and t["micro_batches"] == m and t["schedule"] == schedule)
             for schedule in ("1f1b", "zb-h1") for m in ("2", "3")}
    assert len(whole) == 1 and set(split.values()) == whole
    for s in stages:
        assert int(s["model_states_bytes"]) > 0 and int(s["peak_memory_bytes"]) > 0
    # The micro-batches in flight, as parallel/schedule_model.in_flight counts them: at 2 micro-batches 1f1b's
    # stage 0 holds 2 and its stage 1 one; zb-h1's stage 1 keeps a second graph for its deferred weight half.
    acts = {(s["schedule"], s["stage"]): int(s["peak_activations_bytes"]) for s in stages
            if s["stages"] == "2" and s["micro_batches"] == "2"}
    assert acts[("zb-h1", "1")] / acts[("1f1b", "1")] == pytest.approx(2, rel=0.05)
    assert acts[("zb-h1", "0")] == pytest.approx(acts[("1f1b", "0")], rel=0.05)
    # One micro-batch of each stage is one micro-batch of the whole model, which the 1-stage run holds.
    whole = {int(s["peak_activations_bytes"]) for s in stages if s["stages"] == "1"}
    assert len(whole) == 1 and acts[("1f1b", "0")] / 2 + acts[("1f1b", "1")] == pytest.approx(whole.pop(), rel=0.02)
