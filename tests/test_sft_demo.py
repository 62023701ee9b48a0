"""The synthetic tasks' generator (data synth-task). scripts/sft_demo.sh itself runs, shortened, as the first stage of
tests/test_dpo_demo.py's launch, which checks it as its own launch once did."""

import json
import re

import pytest

from deepseek_ds.data.errors import DataError
from deepseek_ds.data.synthetic import HELDOUT_FILE, TRAIN_FILE, write_task


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
