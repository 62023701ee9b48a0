"""scripts/dpo_demo.sh, shortened (few items, few steps), through the real commands: its first stage, scripts/sft_demo.sh
(the synthetic task, chat preparation, the starting HF model, the task scores before and after 2-rank fine-tuning,
its report), then the SFT model's export, the reversal task's preference pairs, the scores before and after 2-rank
DPO and the report; and the pair generator."""

import json
import math
import re
import subprocess

import pytest

from deepseek_ds.data.synthetic import HELDOUT_FILE, TRAIN_FILE, write_task
from deepseek_ds.utils.net import free_port
from helpers import ROOT, launch_env, read_metrics


def _lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.unit
def test_reversal_pairs_are_deterministic_near_misses_on_the_reversal_words(tmp_path):
    first = write_task(str(tmp_path / "a"), 300, 50, seed=3, kind="reverse-pairs")
    again = write_task(str(tmp_path / "b"), 300, 50, seed=3, kind="reverse-pairs")
    reverse = write_task(str(tmp_path / "r"), 300, 50, seed=3)
    for name in (TRAIN_FILE, HELDOUT_FILE, "tokenizer/tokenizer.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    # One tokenizer for the SFT task and its pairs: the SFT model's token ids fit.
    assert (first / "tokenizer/tokenizer.json").read_bytes() == (reverse / "tokenizer/tokenizer.json").read_bytes()
    train, heldout = _lines(first / TRAIN_FILE), _lines(first / HELDOUT_FILE)
    assert len(train) == 300 and len(heldout) == 50
    # The reversal task's words in its splits: held-out words are neither SFT nor DPO training words.
    assert [p["prompt"] for p in train + heldout] == [i["prompt"] for i in _lines(reverse / TRAIN_FILE)
                                                      + _lines(reverse / HELDOUT_FILE)]
    words = [re.fullmatch(r"reverse ([a-z]{3,5})", p["prompt"]).group(1) for p in train + heldout]
    assert not set(words[:300]) & set(words[300:])
    swaps = 0
    for pair, w in zip(train + heldout, words):
        chosen, rejected = pair["chosen"], pair["rejected"]
        assert chosen == w[::-1] and rejected != chosen and len(rejected) == len(chosen)
        wrong = [i for i in range(len(chosen)) if chosen[i] != rejected[i]]
        # A near miss: one letter replaced, or two adjacent letters swapped.
        assert len(wrong) == 1 or (len(wrong) == 2 and wrong[1] == wrong[0] + 1
                                   and rejected[wrong[0]] == chosen[wrong[1]] and rejected[wrong[1]] == chosen[wrong[0]])
        swaps += len(wrong) == 2
    assert 0.3 < swaps / len(words) < 0.7, swaps


@pytest.mark.launch
def test_dpo_demo_script_connects_its_pieces(tmp_path):
    out, report = tmp_path / "dpo-demo", tmp_path / "report.md"
    sft_report = tmp_path / "sft-report.md"
    env = {**launch_env(), "DPO_DIR": str(out), "DPO_REPORT": str(report), "SFT_N": "400", "SFT_HELDOUT": "16",
           "DPO_SFT_STEPS": "6", "DPO_SFT_REPORT": str(sft_report), "DPO_N": "96", "DPO_STEPS": "4",
           "DPO_INTERVAL": "2", "DPO_SFT_ARGS": f"--master_port {free_port()} --set eval.interval=3"}
    # Its own ports: a demo running at the same time holds deepspeed's default one.
    proc = subprocess.run(["bash", "scripts/dpo_demo.sh", "--master_port", str(free_port())], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    check_sft_stage(out / "sft", proc.stdout, sft_report.read_text())
    # Its checkpoint's fp32 export, scored by the DPO demo, predicts the checkpoint's own answers.
    assert (out / "before-preds.jsonl").read_text() == (out / "sft" / "after-preds.jsonl").read_text()
    metrics = read_metrics(str(out / "dpo"))
    # The reference is the starting weights (the SFT export): at step 1 every reward is 0, and the loss is ln 2 plus
    # RPO's term, the chosen answers' mean negative log-likelihood (positive).
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[0]["rewards_chosen"] == pytest.approx(0, abs=1e-6)
    assert metrics[0]["reward_margin"] == pytest.approx(0, abs=1e-6)
    assert metrics[0]["loss"] > math.log(2)
    assert [m["step"] for m in metrics if "eval_reward_accuracy" in m] == [2, 4]
    j = {name: json.loads((out / f"{name}.json").read_text())
         for name in ("before-task", "after-task", "before-pairs", "after-pairs", "after-dpo-rewards")}
    assert j["before-pairs"]["eval_pairs"] == j["after-pairs"]["eval_pairs"] == 16 and j["after-task"]["n"] == 16
    # The exact match training logged at its last step is the scored checkpoint's; the start's is the SFT export's.
    assert metrics[-1]["task_exact_match"] == j["after-task"]["exact_match"]
    assert j["before-task"]["exact_match"] == json.loads((out / "sft" / "after.json").read_text())["exact_match"]
    # The printed table, and the report's, are the JSON files' numbers.
    first = next(m for m in metrics if "eval_reward_accuracy" in m)
    lines = [f"| held-out preference accuracy (chosen more likely) | {j['before-pairs']['eval_reward_accuracy']:.3f} | "
             f"{j['after-pairs']['eval_reward_accuracy']:.3f} |",
             f"| validation DPO reward accuracy (step 2 -> 4) | {first['eval_reward_accuracy']:.3f} | "
             f"{metrics[-1]['eval_reward_accuracy']:.3f} |",
             "| held-out DPO reward accuracy | ties (every reward 0) | "
             f"{j['after-dpo-rewards']['eval_reward_accuracy']:.3f} |",
             f"| held-out exact match | {j['before-task']['exact_match']:.3f} | {j['after-task']['exact_match']:.3f} |",
             "| steps (SFT, DPO) | 6 | 4 |"]
    text = report.read_text()
    for line in lines:
        assert line in proc.stdout and line in text, line
    assert "git commit" in text and "bash scripts/dpo_demo.sh --master_port" in text


def check_sft_stage(out, stdout: str, text: str) -> None:
    """scripts/sft_demo.sh's run (6 steps, evaluated at 3 and 6, 16 held-out words) and its report `text`."""
    before, after = (json.loads((out / f"{name}.json").read_text()) for name in ("before", "after"))
    # The start is a random initialisation: it answers nothing (docs: 0.000 before fine-tuning).
    assert before["exact_match"] == 0.0 and before["n"] == after["n"] == 16
    line = f"before {before['exact_match']:.3f}, after {after['exact_match']:.3f}"
    # The report holds the printed line, each evaluation's exact match, and where it ran.
    assert line in stdout and line in text and "git commit" in text
    # Six steps answer no held-out word yet, so learning shows in the losses and in answers that are no longer the
    # start's.
    metrics = read_metrics(str(out / "train"))
    train_loss = {m["step"]: m["loss"] for m in metrics}
    val_loss = {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    assert sorted(train_loss) == [1, 2, 3, 4, 5, 6] and sorted(val_loss) == [3, 6]
    for m in metrics:
        if "task_exact_match" in m:
            assert f"| {m['step']} | {m['loss']:.3f} | {m['eval_loss']:.3f} | {m['task_exact_match']:.3f} |" in text
    assert train_loss[6] < 0.9 * train_loss[1], train_loss
    assert val_loss[6] < val_loss[3], val_loss
    # The score training logged at its last step (2 ranks, the engine's weights) is the saved checkpoint's.
    last = metrics[-1]
    assert last["step"] == 6 and last["task_n"] == 16 and last["task_exact_match"] == after["exact_match"]
    preds = _lines(out / "after-preds.jsonl")
    assert [p["prediction"] for p in preds] != [p["prediction"] for p in _lines(out / "before-preds.jsonl")]
    assert [p["reference"] for p in preds] == [item["response"] for item in _lines(out / "task" / HELDOUT_FILE)]
    assert sum(p["prediction"] == p["reference"] for p in preds) / len(preds) == after["exact_match"]
    assert (out / "start-hf" / "config.json").is_file()
