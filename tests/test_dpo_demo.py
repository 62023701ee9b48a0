"""scripts/dpo_demo.sh, shortened (few items, few steps): the SFT demo, its export, the reversal task's preference
pairs, the scores before and after 2-rank DPO and the report, through the real commands; and the pair generator."""

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
    env = {**launch_env(), "DPO_DIR": str(out), "DPO_REPORT": str(report), "SFT_N": "300", "SFT_HELDOUT": "8",
           "DPO_SFT_STEPS": "4", "DPO_N": "96", "DPO_STEPS": "4", "DPO_INTERVAL": "2",
           "DPO_SFT_ARGS": f"--master_port {free_port()}"}
    # Its own ports: a demo running at the same time holds deepspeed's default one.
    proc = subprocess.run(["bash", "scripts/dpo_demo.sh", "--master_port", str(free_port())], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
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
    assert j["before-pairs"]["eval_pairs"] == j["after-pairs"]["eval_pairs"] == 8 and j["after-task"]["n"] == 8
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
             "| steps (SFT, DPO) | 4 | 4 |"]
    text = report.read_text()
    for line in lines:
        assert line in proc.stdout and line in text, line
    assert "git commit" in text and "bash scripts/dpo_demo.sh --master_port" in text
