"""What every report's header names (the command as it would be typed again) and the demo reports' summary of a
run's metrics.jsonl (bench/run_report.py; scripts/mtp_demo.sh's launch test covers its MTP form end to end)."""

import importlib.machinery
import json
import os
import sys
import types

import pytest

from deepseek_ds.bench import report, run_report
from helpers import ROOT

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
