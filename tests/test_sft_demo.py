"""scripts/sft_demo.sh, shortened (few items, few steps): the synthetic task, chat preparation, the starting HF
model, the task scores before and after 2-rank fine-tuning, all through the real commands; and the synthetic task's
generator itself."""

import json
import os
import re
import subprocess

import pytest

from deepseek_ds.data.errors import DataError
from deepseek_ds.data.synthetic import HELDOUT_FILE, TRAIN_FILE, write_task
from helpers import ROOT, cli, launch_env, read_metrics


def _lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.unit
def test_synthetic_task_is_deterministic_answerable_and_disjoint(tmp_path):
    from transformers import AutoTokenizer

    first, again = write_task(str(tmp_path / "a"), 300, 50, seed=3), write_task(str(tmp_path / "b"), 300, 50, seed=3)
    for name in (TRAIN_FILE, HELDOUT_FILE, "tokenizer/tokenizer.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    train, heldout = _lines(first / TRAIN_FILE), _lines(first / HELDOUT_FILE)
    assert len(train) == 300 and len(heldout) == 50
    words = [re.fullmatch(r"reverse ([a-z]{3,5})", item["prompt"]).group(1) for item in train + heldout]
    assert all(item["response"] == w[::-1] for item, w in zip(train + heldout, words))
    assert not set(words[:300]) & set(words[300:]) and len(set(words)) == 350
    assert _lines(write_task(str(tmp_path / "c"), 300, 50, seed=4) / TRAIN_FILE) != train
    tok = AutoTokenizer.from_pretrained(str(first / "tokenizer"))
    assert len(tok) == 260 and tok.bos_token == "<｜begin▁of▁sentence｜>"
    assert [tok.convert_ids_to_tokens(i) for i in (1, 2, 3)] == ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
    # One token per letter: a reversed answer is its tokens reversed.
    assert tok("kqzt", add_special_tokens=False).input_ids == tok("tzqk", add_special_tokens=False).input_ids[::-1]


@pytest.mark.unit
def test_copy_task_draws_the_reversal_words_and_shares_its_tokenizer(tmp_path):
    reverse = write_task(str(tmp_path / "r"), 300, 50, seed=3)
    copy = write_task(str(tmp_path / "c"), 300, 50, seed=3, kind="copy")
    train, heldout = _lines(copy / TRAIN_FILE), _lines(copy / HELDOUT_FILE)
    words = [re.fullmatch(r"copy ([a-z]{3,5})", item["prompt"]).group(1) for item in train + heldout]
    assert all(item["response"] == w for item, w in zip(train + heldout, words))
    assert not set(words[:300]) & set(words[300:]) and len(set(words)) == 350
    # The same words as the reversal task in the same splits: a base pretrained on copy's training items never saw a
    # reversal held-out word; and one tokenizer for both, so the base's token ids are the LoRA data's.
    reversed_words = [item["response"][::-1] for item in _lines(reverse / TRAIN_FILE) + _lines(reverse / HELDOUT_FILE)]
    assert reversed_words == words
    assert (copy / "tokenizer/tokenizer.json").read_bytes() == (reverse / "tokenizer/tokenizer.json").read_bytes()
    with pytest.raises(DataError, match="--kind 'sort'"):
        write_task(str(tmp_path / "s"), 300, 50, seed=3, kind="sort")


@pytest.mark.launch
def test_sft_demo_script_connects_its_pieces(tmp_path):
    out = tmp_path / "sft"
    report = tmp_path / "report.md"
    env = {**launch_env(), "SFT_DIR": str(out), "SFT_N": "400", "SFT_HELDOUT": "16", "SFT_STEPS": "6",
           "SFT_REPORT": str(report)}
    proc = subprocess.run(["bash", "scripts/sft_demo.sh", "--set", "eval.interval=3", "--set", "checkpoint.interval=6"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    before, after = (json.loads((out / f"{name}.json").read_text()) for name in ("before", "after"))
    # The start is a random initialisation: it answers nothing (README: 0.000 before fine-tuning).
    assert before["exact_match"] == 0.0 and before["n"] == after["n"] == 16
    assert f"before {before['exact_match']:.3f}, after {after['exact_match']:.3f}" in proc.stdout
    # The report holds the printed line, each evaluation's exact match, and where it ran.
    text = report.read_text()
    assert f"before {before['exact_match']:.3f}, after {after['exact_match']:.3f}" in text and "git commit" in text
    # Six steps answer no held-out word yet (README: 0.025 after 250 steps), so learning shows in the losses: measured
    # 5.56 -> 4.77 training, 4.99 -> 4.67 validation (steps 3 -> 6), and in answers that are no longer the start's.
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
    # Scoring the final checkpoint again, separately, predicts the same answers.
    again = tmp_path / "again.jsonl"
    assert cli(["eval", "--task", str(out / "task" / HELDOUT_FILE), "--checkpoint", str(out / "train" / "checkpoints"),
                "--predictions", str(again), "--max-new-tokens", "8"]) == 0
    assert again.read_text() == (out / "after-preds.jsonl").read_text()
    assert os.path.isfile(out / "start-hf" / "config.json")
