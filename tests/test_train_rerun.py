"""Re-running and extending a run through the real launcher: a finished run says so, an extended run reports this
session's throughput and keeps each step once in metrics.jsonl, and a redirected console gets plain progress lines
instead of a progress bar."""

import math
import shutil

import pytest

from helpers import read_metrics, run_ranks

pytestmark = pytest.mark.launch


LR, MIN_LR, WARMUP = 3e-3, 3e-4, 2  # tiny-v3's lr and min_lr; the warm-up set below


def _train(out: str, data_dir: str, steps: int, *sets: str):
    args = ["train.py", "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}", "--set",
            f"data.path={data_dir}", "--set", f"train.steps={steps}", "--set", "data.seq_len=32", "--set",
            f"train.warmup_steps={WARMUP}", "--set", "train.log_interval=2"]
    for s in sets:
        args += ["--set", s]
    return run_ranks(2, args)


def expected_lr(step: int, total: int) -> float:
    """The rate of optimizer step `step` (1-based) under linear warm-up from lr/warmup, then cosine to min_lr over
    `total` steps, flat at min_lr after it: the schedule README and ds_configs describe, written out."""
    i = step - 1
    if i < WARMUP:
        return LR * (1 / WARMUP + (i / WARMUP) * (1 - 1 / WARMUP))
    progress = min(1.0, (i - WARMUP + 1) / (total - WARMUP))
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * progress)) / 2


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rerun"))
    first = _train(out, data_dir, 4)
    first_metrics = read_metrics(out)
    replan = str(tmp_path_factory.mktemp("replan"))
    shutil.copytree(out, replan, dirs_exist_ok=True)
    again = _train(out, data_dir, 4)
    extended = _train(out, data_dir, 6)
    replanned = _train(replan, data_dir, 6, "train.resume_schedule=replan")
    return {"out": out, "first": first, "first_metrics": first_metrics, "again": again, "extended": extended,
            "replan": replan, "replanned": replanned}


def test_redirected_console_gets_plain_progress_lines(runs):
    stdout, stderr = runs["first"].stdout, runs["first"].stderr
    for step in (2, 4):
        assert f"step {step}/4  loss " in stdout
    assert "step 1/4  loss " not in stdout and "step 3/4  loss " not in stdout  # every train.log_interval steps
    assert "train:" not in stderr and "\r" not in stderr  # no tqdm bar in a redirected log
    # Noise a user cannot act on stays out of the console.
    for noise in ("Setting accelerator to CPU", "built successfully", "FutureWarning",
                  "Attempting to get learning rate from scheduler"):
        assert noise not in stdout + stderr, noise


def test_rerun_of_a_finished_run_says_it_is_complete(runs):
    assert "already complete:" in runs["again"].stdout and "step 4 of train.steps 4" in runs["again"].stdout
    assert "checkpoint  None" not in runs["again"].stdout


def test_extended_run_keeps_each_step_once_and_reports_its_own_throughput(runs):
    records = read_metrics(runs["out"])
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[:4] == runs["first_metrics"]
    assert "steps 5-6 after the resume" in runs["extended"].stdout


def test_resume_with_more_steps_keeps_or_replans_the_schedule_as_chosen(runs):
    kept, replanned = read_metrics(runs["out"]), read_metrics(runs["replan"])
    assert [r["lr"] for r in kept[:4]] == pytest.approx([expected_lr(s, 4) for s in range(1, 5)], rel=1e-6)
    # keep (the default): steps 5-6 stay at the old schedule's end; replan: the cosine over 6 steps, from step 5 on.
    assert [r["lr"] for r in kept[4:]] == pytest.approx([MIN_LR, MIN_LR], rel=1e-6)
    assert [r["lr"] for r in replanned[4:]] == pytest.approx([expected_lr(s, 6) for s in (5, 6)], rel=1e-6)
    assert expected_lr(5, 6) > 2 * MIN_LR  # the two choices really differ
    assert "train.steps changed 4 -> 6" in runs["extended"].stdout and "resume_schedule: replan" in runs["extended"].stdout
    assert "re-planned over 6 steps" in runs["replanned"].stdout
