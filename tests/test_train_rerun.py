"""Re-running and extending a run through the real launcher: a finished run says so, an extended run reports this
session's throughput and keeps each step once in metrics.jsonl, and a redirected console gets plain progress lines
instead of a progress bar."""

import pytest

from helpers import deepspeed, read_metrics

pytestmark = pytest.mark.launch


def _train(out: str, data_dir: str, steps: int):
    return deepspeed(2, ["train.py", "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}",
                         "--set", f"data.path={data_dir}", "--set", f"train.steps={steps}", "--set", "data.seq_len=32",
                         "--set", "train.warmup_steps=2", "--set", "train.log_interval=2"])


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rerun"))
    first = _train(out, data_dir, 4)
    first_metrics = read_metrics(out)
    again = _train(out, data_dir, 4)
    extended = _train(out, data_dir, 6)
    return {"out": out, "first": first, "first_metrics": first_metrics, "again": again, "extended": extended}


def test_redirected_console_gets_plain_progress_lines(runs):
    stdout, stderr = runs["first"].stdout, runs["first"].stderr
    for step in (2, 4):
        assert f"step {step}/4  loss " in stdout
    assert "step 1/4  loss " not in stdout and "step 3/4  loss " not in stdout  # every train.log_interval steps
    assert "train:" not in stderr and "\r" not in stderr  # no tqdm bar in a redirected log


def test_rerun_of_a_finished_run_says_it_is_complete(runs):
    out = runs["out"]
    assert "already complete:" in runs["again"].stdout and "step 4 of train.steps 4" in runs["again"].stdout
    assert "checkpoint  None" not in runs["again"].stdout


def test_extended_run_keeps_each_step_once_and_reports_its_own_throughput(runs):
    records = read_metrics(runs["out"])
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[:4] == runs["first_metrics"]
    assert "steps 5-6 after the resume" in runs["extended"].stdout
