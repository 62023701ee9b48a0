"""What every report's header names (the command as it would be typed again), the timed steps' spread, the host's
load (sampled while a benchmark runs; a busy host refused before any launch) and the demo reports' summary of a
run's metrics.jsonl (bench/run_report.py; scripts/mtp_demo.sh's launch test covers its MTP form end to end)."""

import importlib.machinery
import json
import os
import sys
import time
import types

import pytest

from deepseek_ds.bench import (
    checkpoint_bench,
    data_bench,
    failure_bench,
    launch,
    lora_bench,
    overhead,
    pipeline_bench,
    report,
    run_report,
    sequence_bench,
    zero_bench,
)
from deepseek_ds.bench import load as host_load
from deepseek_ds.utils.errors import UserError
from helpers import ROOT, cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv0, spec, typed", [
    (os.path.join(ROOT, "deepseek_ds", "__main__.py"), "deepseek_ds.__main__", "python -m deepseek_ds"),
    (os.path.join(ROOT, "deepseek_ds", "bench", "run_report.py"), "deepseek_ds.bench.run_report",
     "python -m deepseek_ds.bench.run_report"),
    (os.path.join(ROOT, "scripts", "zero3_startup_memory.py"), None, "python scripts/zero3_startup_memory.py"),
    (os.path.join(ROOT, ".venv", "bin", "deepseek-ds"), None, "deepseek-ds"),
])
def test_report_names_the_command_as_it_is_typed(monkeypatch, argv0, spec, typed):
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.machinery.ModuleSpec(spec, None) if spec else None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [argv0, "bench", "data", "--out", "x.md"])
    assert report.command_line() == f"{typed} bench data --out x.md"


def test_run_report_summarises_the_runs_metrics(tmp_path, capsys):
    metrics = [{"step": 1, "loss": 7.6624, "tokens_per_sec": 100.0},
               {"step": 2, "loss": 5.5, "tokens_per_sec": 3000.0, "eval_loss": 5.75},
               {"step": 3, "loss": 3.92731, "tokens_per_sec": 5000.0, "eval_loss": 4.3219}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    out = tmp_path / "demo.md"
    assert run_report.main([str(tmp_path), "--seconds", "95", "--ranks", "2", "--title", "Demo", "--what", "tiny",
                            "--command", "DEMO_REPORT=x bash scripts/demo.sh", "--out", str(out)]) == 0
    # step 1 is warm-up: the speed is the mean of steps 2 and 3
    lines = ["loss 7.66 -> 3.93 over 3 steps", "validation loss 4.32 (step 3)", "4,000 tokens/s (2 ranks), 95 s in all"]
    assert capsys.readouterr().out.splitlines()[:3] == lines
    text = out.read_text()
    assert text.startswith("# Demo\n\ntiny\n")
    assert "- **command**: DEMO_REPORT=x bash scripts/demo.sh" in text and "- **git commit**: " in text
    assert "\n".join(lines) in text
    assert ("| step | loss | validation loss |\n|--:|--:|--:|\n| 1 | 7.662 |  |\n| 2 | 5.500 | 5.750 |\n"
            "| 3 | 3.927 | 4.322 |") in text


def _rank_report(seconds: list[float], timed_from: int = 1) -> dict:
    return {"steps": [{"seconds": s, "timed": i >= timed_from} for i, s in enumerate(seconds)],
            "global_batch_size": 4, "seq_len": 10, "flops_per_token": 6.0, "world": 2, "peak_tflops": None,
            "micro_batch_size": 2, "grad_accum": 1}


def test_step_metrics_report_the_spread_of_the_slowest_rank_per_step():
    # Step 0 is warm-up. Per timed step the slowest rank decides: 2.0, 4.0, 1.0 -> median 2.0, fastest 1.0.
    metrics = launch.step_metrics([_rank_report([9.0, 2.0, 3.0, 1.0]), _rank_report([9.0, 1.5, 4.0, 0.5])])
    tokens = 4 * 10
    assert (metrics["step_time_min_s"], metrics["step_time_s"], metrics["step_time_max_s"]) == (1.0, 2.0, 4.0)
    assert (metrics["tokens_per_s_min"], metrics["tokens_per_s"], metrics["tokens_per_s_max"]) == (
        tokens / 4.0, tokens / 2.0, tokens / 1.0)
    assert metrics["tokens_per_s_spread"] == "10 / 20 / 40"
    assert metrics["timed_steps"] == 3


def test_host_load_is_sampled_during_the_run_and_busy_beyond_the_benchmarks_own_threads(monkeypatch):
    cores = host_load.host_cores()
    calls = []

    def getloadavg():  # quiet when the benchmark starts, busy from then on
        calls.append(1)
        return (0.5 if len(calls) == 1 else cores + 2.5), 0.0, 0.0

    monkeypatch.setattr(os, "getloadavg", getloadavg)
    monkeypatch.setattr(host_load, "runnable_now", lambda: 0)
    monkeypatch.setattr(host_load, "runnable_tasks", lambda: cores + 2)
    with host_load.HostLoad(interval=0.05, own_tasks=cores) as load:
        deadline = time.monotonic() + 300  # a hang guard only: the check waits for the sampler's first sample
        while not load.samples:
            assert time.monotonic() < deadline, "the sampler took no sample in 300 s"
            time.sleep(0.01)
    assert load.before == 0.5 and len(load.samples) >= 2 and set(load.samples) == {cores + 2.5}
    assert set(load.runnable) == {cores + 2}
    assert load.busy and "busy host" in load.banner() and f"{cores + 2.5:.1f} max" in load.describe()
    # The benchmark's own ranks (cores + 2 threads, say 4 ranks x 1 on 2 cores) and its launcher are not other work.
    load.own_tasks = cores + 2
    assert not load.busy and load.banner() == ""


def test_a_host_quiet_now_is_not_refused_for_its_last_minute(monkeypatch):
    # A benchmark that has just ended leaves the minute's load average above the cores on a host now idle.
    cores = host_load.host_cores()
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 0.5, 1.0, 1.0))
    monkeypatch.setattr(host_load, "runnable_now", lambda: 0)
    host_load.check_quiet_host(allow_busy=False)
    monkeypatch.setattr(host_load, "runnable_now", lambda: cores + 1)
    with pytest.raises(UserError, match="load average .* and .* tasks runnable now .*--allow-busy"):
        host_load.check_quiet_host(allow_busy=False)
    host_load.check_quiet_host(allow_busy=True)


@pytest.mark.parametrize("bench", ["zero", "pipeline", "lora", "sp", "overhead", "checkpoint", "data", "failures"])
def test_a_busy_host_is_refused_before_any_launch(monkeypatch, tmp_path, capsys, bench):
    def measure(*args, **kwargs):
        raise AssertionError("measured on a busy host")

    for module, name in ((zero_bench, "launch"), (pipeline_bench, "launch"), (lora_bench, "launch"),
                         (sequence_bench, "launch"), (overhead, "rows"), (checkpoint_bench, "run_checkpoint_bench"),
                         (data_bench, "run_data_bench"), (failure_bench, "run_failure_bench")):
        monkeypatch.setattr(module, name, measure)
    monkeypatch.setattr(os, "getloadavg", lambda: (host_load.host_cores() + 0.5, 1.0, 1.0))
    monkeypatch.setattr(host_load, "runnable_now", lambda: host_load.host_cores() + 1)
    monkeypatch.chdir(ROOT)
    config = ["--config", "recipes/tiny-v3.yaml"] if bench not in ("data", "failures") else []
    assert cli(["bench", bench, *config, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deepseek-ds: error: this host is busy: load average") and "--allow-busy" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
