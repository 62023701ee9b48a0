"""`deepseek-ds bench pipeline`: the bubble formula, the per-rank idle measure, and a real sweep of 1 and 2
stages x 1 and 2 micro-batches (two launches) that writes every report file, with the same threads in every rank of
every row."""

import csv
import json
import os

import pytest

from deepseek_ds.bench.pipeline_bench import bubble_theory, replica_bubble
from helpers import ROOT, cli, launch_env


@pytest.mark.unit
def test_bubble_formula():
    assert bubble_theory(1, 8) == 0
    assert bubble_theory(4, 1) == pytest.approx(3 / 4)
    assert bubble_theory(2, 16) == pytest.approx(1 / 17)


@pytest.mark.unit
def test_measured_bubble_is_the_idle_share_of_the_window():
    def steps(*timed):  # (compute, span) per timed step, after one untimed warm-up step
        return {"steps": [{"compute": 0.0, "span": 9.0, "timed": False}]
                + [{"compute": c, "span": w, "timed": True} for c, w in timed]}

    # Two stages; stage 0's span is the window. Step 1: 2 + 1 busy of 2 x 3 -> 0.5; step 2: 2 + 2 of 2 x 2 -> 0.
    bubble, idle = replica_bubble([steps((2.0, 3.0), (2.0, 2.0)), steps((1.0, 1.0), (2.0, 2.0))])
    assert bubble == pytest.approx(0.25)  # median of 0.5 and 0
    assert idle == pytest.approx([(1 / 3 + 0) / 2, (2 / 3 + 0) / 2])


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
    assert cli(["bench", "pipeline", "--config", "recipes/tiny-v3.yaml", "--stages", "1,2", "--micro-batches", "1,2",
                "--steps", "2", "--warmup", "1", "--allow-busy", "--out", str(out)]
               + [a for s in sets for a in ("--set", s)]) == 0

    for name in ("pipeline.md", "pipeline.csv", "pipeline_stages.csv", "pipeline_throughput.png",
                 "pipeline_bubble.png"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "pipeline.md").read_text()
    assert "(p-1)/(m+p-1)" in md and "## Environment" in md and "git commit" in md

    # Every rank of every row, the 1-stage rows' included, ran the threads chosen for the largest launch (2 ranks),
    # as each rank measured them: a 1-rank launch on all the cores is another machine (55x slower on a busy host).
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for p in (1, 2):
        with open(out / "raw" / f"pp{p}.result.json") as f:
            measured = {rank["threads"] for variant in json.load(f)["variants"] for rank in variant}
        assert measured == {threads}, f"p={p}"
    assert f"launched with {threads} torch thread(s)" in md
    assert f"**torch threads per rank (as the ranks measured them)**: {threads}\n" in md

    with open(out / "pipeline.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["stages"]), int(r["micro_batches"])) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in rows:
        assert float(r["bubble_theory"]) == pytest.approx(bubble_theory(int(r["stages"]), int(r["micro_batches"])))
        assert 0 <= float(r["bubble_measured"]) < 1 and float(r["tokens_per_s"]) > 0
        assert int(r["global_batch_size"]) == 2 * int(r["micro_batches"])
        assert r["threads"] == str(threads)
        # Two timed steps: the median is their mean, between the slowest and the fastest.
        low, median, high = (float(r[k]) for k in ("tokens_per_s_min", "tokens_per_s", "tokens_per_s_max"))
        assert low <= median <= high and 1 / median == pytest.approx((1 / low + 1 / high) / 2)
    with open(out / "pipeline_stages.csv") as f:
        stages = list(csv.DictReader(f))
    assert len(stages) == 1 + 1 + 2 + 2
    # Two stages split the model's parameters between them: nothing lost, nothing duplicated (no tied weights).
    whole = {int(s["params"]) for s in stages if s["stages"] == "1"}
    split = {m: sum(int(t["params"]) for t in stages if t["stages"] == "2" and t["micro_batches"] == m)
             for m in ("1", "2")}
    assert len(whole) == 1 and set(split.values()) == whole
    for s in stages:
        assert int(s["model_states_bytes"]) > 0 and int(s["peak_memory_bytes"]) > 0
