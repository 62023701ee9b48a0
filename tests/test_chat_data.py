"""Chat datasets (`data prepare --format chat`), their run-time sequences (data/sft.py) and raw text with
document_mask: labels against chat.encode of each conversation, byte-identical and resumable preparation,
first-fit packing that never splits a sample, truncation counts, `data dump` against micro_batches, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from deepseek_ds.config import load_ds_config, load_run_config, validate
from deepseek_ds.data import (
    ChatDataset,
    DataError,
    GlobalBatchSampler,
    PackedDataset,
    dataset_info,
    load_tokenizer,
    micro_batches,
    open_dataset,
    prepare_dataset,
)
from deepseek_ds.data.chat import ChatFormatError, encode, parse_line
from deepseek_ds.data.layout import META
from deepseek_ds.data.prepare import split_rows
from deepseek_ds.data.sft import dataset_option_notes
from helpers import IGNORE_INDEX, cli, refused

pytestmark = pytest.mark.unit

WORDS = ["prime", "seven", "why", "because", "the", "answer", "is", "two", "λ", "数据", "ok", "list", "sort"]
N_CONVERSATIONS = 40
SHARD_MB = 0.001  # ~1 KB of lines per shard: several shards


def _text(rng, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))))


def _conversation(i: int) -> dict:
    rng = np.random.default_rng(i)
    if i % 3 == 0:
        return {"prompt": _text(rng, 2, 8), "response": _text(rng, 1, 30 if i % 2 else 6)}
    messages = [{"role": "system", "content": _text(rng, 1, 4)}] if i % 2 else []
    for _ in range(int(rng.integers(1, 4))):
        messages += [{"role": "user", "content": _text(rng, 1, 10)},
                     {"role": "assistant", "content": _text(rng, 1, 40 if i % 5 == 0 else 8)}]
    return {"messages": messages}


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "conversations.jsonl"
    path.write_text("".join(json.dumps(_conversation(i), ensure_ascii=False) + "\n" for i in range(N_CONVERSATIONS)),
                    encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def deepseek_chat(chat_file, deepseek_tokenizer_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("deepseek_chat") / "ds"
    return prepare_dataset([str(chat_file)], str(out), tokenizer_dir=deepseek_tokenizer_dir, valid_fraction=0.1,
                           shard_mb=SHARD_MB, progress=False, data_format="chat")


def _expected(tok, path: Path, rows, train_on: str) -> list[tuple[list[int], list[int]]]:
    """(input ids, shifted labels) of each conversation `rows` of the file, from chat.encode."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for r in rows:
        enc = encode(tok, parse_line(lines[r], "x"), train_on)
        labels = [enc.ids[t + 1] if enc.trained[t + 1] else IGNORE_INDEX for t in range(len(enc.ids) - 1)]
        out.append((enc.ids, labels + [IGNORE_INDEX]))
    return out


def _samples(ds: ChatDataset) -> list[list[tuple[list[int], list[int]]]]:
    """Per sequence, its samples cut where position_ids restart, padding (all labels -100, pad ids) dropped."""
    out = []
    for i in range(len(ds)):
        x, y, p = ds[i]
        starts = np.flatnonzero(p == 0).tolist() + [len(p)]
        runs = [(x[a:b].tolist(), y[a:b].tolist()) for a, b in zip(starts, starts[1:])]
        out.append(runs)
    return out


def _tree(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def test_labels_are_chat_encode_on_assistant_turns_only(deepseek_chat, chat_file, deepseek_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    meta = dataset_info(deepseek_chat)
    assert meta["format"] == "chat" and meta["train_on"] == "all" and meta["bad_lines"] == 0
    assert len(meta["splits"]["train"]["shards"]) >= 3
    rows = split_rows(N_CONVERSATIONS, 0.1, 0)
    for split in ("train", "valid"):
        ds = ChatDataset(deepseek_chat, 512, split)
        expected = _expected(tok, chat_file, rows[split], "all")
        assert len(ds) == len(expected) == meta["splits"][split]["num_docs"]
        for (x, y), runs in zip(expected, _samples(ds)):
            (sx, sy), pad = runs[0], runs[1:]
            assert sx == x and sy == y
            assert all(set(py) == {IGNORE_INDEX} and set(px) == {tok.eos_token_id} for px, py in pad)
            x_t, y_t, p_t = ds[0]
    assert x_t.dtype == y_t.dtype == p_t.dtype == np.int64


def test_tiny_bpe_train_on_last_and_two_workers_byte_identical_and_resumable(chat_file, tmp_path):
    common = ["--input", str(chat_file), "--format", "chat", "--train-on", "last", "--vocab-size", "300",
              "--valid-fraction", "0.1", "--shard-mb", str(SHARD_MB), "--no-progress"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli(["data", "prepare", "--out", str(one), "--workers", "1", *common]) == 0
    assert cli(["data", "prepare", "--out", str(two), "--workers", "2", *common]) == 0
    first = _tree(str(one))
    assert first == _tree(str(two)) and any(name.endswith(".mask") for name in first)
    tok = load_tokenizer(str(one))
    assert len(tok) == dataset_info(str(one))["vocab_size"] == 300  # merges + EOS + BOS + the two chat markers
    rows = split_rows(N_CONVERSATIONS, 0.1, 0)["train"]
    expected = _expected(tok, chat_file, rows, "last")
    assert [runs[0] for runs in _samples(ChatDataset(str(one), 512))] == expected
    # Only the final assistant turn is trained: one run of labels ending in EOS, in every sample.
    for _, labels in expected:
        trained = np.flatnonzero(np.array(labels) != IGNORE_INDEX)
        assert len(trained) and np.all(np.diff(trained) == 1) and labels[trained[-1]] == tok.eos_token_id
    # Resumable: damaged or missing shard files are rebuilt to the same bytes, the others kept.
    (one / "train-00001.mask").unlink()
    (one / "train-00002.bin").write_bytes(b"\0" * (one / "train-00002.bin").stat().st_size)
    kept = (one / "train-00000.bin").stat().st_mtime_ns
    assert cli(["data", "prepare", "--out", str(one), "--workers", "2", *common]) == 0
    assert _tree(str(one)) == first and (one / "train-00000.bin").stat().st_mtime_ns == kept


def test_packing_is_first_fit_in_order_and_never_splits_a_sample(deepseek_chat, chat_file, deepseek_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    expected = _expected(tok, chat_file, split_rows(N_CONVERSATIONS, 0.1, 0)["train"], "all")
    seq_len = 64
    ds = ChatDataset(deepseek_chat, seq_len, packing=True)
    # Independent first fit: a sequence's free room is seq_len minus what it holds.
    bins: list[list[int]] = []
    for j, (x, _) in enumerate(expected):
        if len(x) > seq_len:
            continue
        room = [seq_len - sum(len(expected[k][0]) for k in b) for b in bins]
        slot = next((b for b, r in enumerate(room) if r >= len(x)), None)
        bins.append([j]) if slot is None else bins[slot].append(j)
    dropped = sum(len(x) > seq_len for x, _ in expected)
    assert 0 < dropped < len(expected) and len(bins) < len(expected) - dropped  # some packing happens
    assert ds.counts == {"samples": len(expected), "truncated": 0, "dropped": dropped, "sequences": len(bins)}
    for b, runs in zip(bins, _samples(ds)):
        used = sum(len(expected[k][0]) for k in b)
        assert runs[:len(b)] == [expected[k] for k in b]
        assert sum(len(r[0]) for r in runs[len(b):]) == seq_len - used  # the rest is one padding run
        assert len(runs) == len(b) + (used < seq_len)
    assert "dropped" in ds.report() and f"{len(bins)} sequences" in ds.report()


@pytest.mark.parametrize("truncation", ["drop", "truncate_left", "truncate_right"])
def test_truncation_modes_and_counts(deepseek_chat, chat_file, deepseek_tokenizer_dir, truncation):
    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    expected = _expected(tok, chat_file, split_rows(N_CONVERSATIONS, 0.1, 0)["train"], "all")
    seq_len = 40
    long = [len(x) > seq_len for x, _ in expected]
    ds = ChatDataset(deepseek_chat, seq_len, truncation=truncation)
    got = [runs[0] for runs in _samples(ds)]
    if truncation == "drop":
        assert got == [e for e, cut in zip(expected, long) if not cut]
        assert ds.counts["dropped"] == sum(long) > 0 and ds.counts["truncated"] == 0
        return
    assert ds.counts["truncated"] == sum(long) > 0 and ds.counts["dropped"] == 0
    for (x, y), cut, (gx, gy) in zip(expected, long, got):
        if not cut:
            assert (gx, gy) == (x, y)
        elif truncation == "truncate_right":
            assert gx == x[:seq_len] and gy == y[:seq_len - 1] + [IGNORE_INDEX]
        else:
            assert gx == x[-seq_len:] and gy == y[-seq_len:]


def test_dump_is_what_micro_batches_yield(deepseek_chat, capsys):
    count = 6
    assert cli(["data", "dump", "--data", deepseek_chat, "--seq-len", "128", "--packing", "--shuffle", "--seed", "3",
                "--count", str(count), "--truncation", "truncate_left"]) == 0
    dumped = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    options = SimpleNamespace(seq_len=128, packing=True, truncation="truncate_left", document_mask=False)
    ds = open_dataset(deepseek_chat, options)
    # 2 ranks x micro-batches of 1 x 3 accumulation steps: global batch 6 in training order over both ranks.
    yielded = []
    for rank in range(2):
        batch = next(micro_batches(ds, GlobalBatchSampler(len(ds), count, 1, rank, 2, seed=3, shuffle=True)))
        yielded += [{"input_ids": x[0].tolist(), "labels": y[0].tolist(), "position_ids": p[0].tolist()}
                    for x, y, p in batch]
    assert dumped == yielded
    for row in dumped:
        x, y, p = (np.array(row[k]) for k in ("input_ids", "labels", "position_ids"))
        assert len(x) == len(y) == len(p) == 128
        nxt = np.flatnonzero(y != IGNORE_INDEX)
        assert np.all(y[nxt] == x[nxt + 1]) and np.all(p[nxt + 1] != 0)  # a label is the next token of its sample


def test_raw_text_document_mask_restarts_positions_after_eos(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(_text(np.random.default_rng(i), 3, 30) + "\n", encoding="utf-8")
    out = prepare_dataset([str(docs)], str(tmp_path / "ds"), vocab_size=300, valid_fraction=0, progress=False)
    eos, seq_len = dataset_info(out)["eos_id"], 16
    plain = PackedDataset(out, seq_len)
    masked = open_dataset(out, SimpleNamespace(seq_len=seq_len, packing=False, truncation="drop", document_mask=True))
    for i in range(len(plain)):
        tokens = plain[i].tolist()
        position, want_pos, want_labels = 0, [], []
        for t in range(seq_len):  # by hand: count up, restart after an EOS input; an EOS predicts nothing
            want_pos.append(position)
            want_labels.append(IGNORE_INDEX if tokens[t] == eos else tokens[t + 1])
            position = 0 if tokens[t] == eos else position + 1
        x, y, p = masked[i]
        assert x.tolist() == tokens[:-1] and y.tolist() == want_labels and p.tolist() == want_pos
    assert sum(masked[i][2].tolist().count(0) for i in range(len(masked))) > len(masked)  # documents do restart
    x, y, p = next(micro_batches(masked, GlobalBatchSampler(len(masked), 2, 2, 0, 1, seed=0, shuffle=False)))[0]
    assert x.tolist() == [masked[0][0].tolist(), masked[1][0].tolist()] and p[1].tolist() == masked[1][2].tolist()
    assert cli(["data", "dump", "--data", out, "--seq-len", str(seq_len), "--document-mask", "--start", "1"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row == dict(zip(("input_ids", "labels", "position_ids"), masked[1].tolist()))
    # Without document_mask nothing changes: pairs, as before.
    assert len(next(micro_batches(plain, GlobalBatchSampler(len(plain), 1, 1, 0, 1, seed=0)))[0]) == 2


def test_bad_lines_name_file_and_line_or_are_skipped_and_counted(tmp_path, deepseek_tokenizer_dir, capsys):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps({"prompt": "hi", "response": "hello"})
    path.write_text("\n".join([good, "{not json", json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
                               json.dumps({"messages": []}), json.dumps({"messages": [{"role": "user",
                                                                                      "content": "x"}]}), good]) + "\n")
    with pytest.raises(ChatFormatError, match=rf"{path}:2: not JSON .*--skip-bad"):
        prepare_dataset([str(path)], str(tmp_path / "a"), tokenizer_dir=deepseek_tokenizer_dir, progress=False,
                        data_format="chat")
    assert cli(["data", "prepare", "--input", str(path), "--out", str(tmp_path / "b"), "--format", "chat",
                "--tokenizer", deepseek_tokenizer_dir, "--skip-bad", "--valid-fraction", "0", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "4 bad lines skipped" in printed and f"{path}:3: message 0: unknown role 'bot'" in printed
    assert f"{path}:4: empty conversation" in printed and f"{path}:5: no assistant turn" in printed
    assert dataset_info(str(tmp_path / "b"))["splits"]["train"]["num_docs"] == 2


def test_validate_refuses_packing_on_text_and_a_chat_dataset_all_dropped(deepseek_chat, data_dir, tmp_path):
    def config(*sets):
        cfg = load_run_config("recipes/tiny-v3.yaml", list(sets))
        return cfg, load_ds_config(cfg.deepspeed_config)

    msg = refused(*config(f"data.path={data_dir}", "data.packing=true", "data.truncation=truncate_left"), world=2)
    assert "data.packing is for chat datasets" in msg and "data.truncation = truncate_left is for chat" in msg
    assert len(msg.splitlines()) == 3
    refused(*config(f"data.path={deepseek_chat}", "data.seq_len=4", "model.overrides.vocab_size=129280",
                   "eval.interval=0"), world=2,
            match=r"all 36 chat samples of its train split are longer than data.seq_len 4 .* set "
                  r"data.truncation: truncate_right")
    refused(*config(f"data.path={deepseek_chat}", "data.seq_len=4", "model.overrides.vocab_size=129280",
                    "eval.interval=5"), world=2, match=r"chat samples of its valid split are longer than")
    validate(*config(f"data.path={deepseek_chat}", "eval.interval=5", "model.overrides.vocab_size=129280"), 2,
             cuda_available=False)  # the validation loss reads chat data too
    no_valid = shutil.copytree(deepseek_chat, tmp_path / "no_valid")
    meta = json.loads((no_valid / META).read_text())
    meta["splits"]["valid"] = {**meta["splits"]["valid"], "num_docs": 0, "num_tokens": 0, "shards": []}
    (no_valid / META).write_text(json.dumps(meta))
    refused(*config(f"data.path={no_valid}", "eval.interval=5", "model.overrides.vocab_size=129280"), world=2,
            match=r"validation split of .* holds no conversation: prepare it with a --valid-fraction > 0")
    cfg, ds = config(f"data.path={deepseek_chat}", "data.seq_len=64", "data.packing=true",
                     "model.overrides.vocab_size=129280", "eval.interval=0")
    validate(cfg, ds, 2, cuda_available=False)  # packing a chat dataset that fits is fine
    with pytest.raises(DataError, match="is a chat dataset"):
        PackedDataset(deepseek_chat, 16)


def test_a_copied_chat_dataset_with_a_corrupted_mask_is_refused_on_read(deepseek_chat, tmp_path):
    copy = shutil.copytree(deepseek_chat, tmp_path / "copy")
    mask = copy / "train-00000.mask"
    data = bytearray(mask.read_bytes())
    data[0] ^= 1
    mask.write_bytes(bytes(data))
    ds = ChatDataset(str(copy), 512)
    with pytest.raises(DataError, match=r"train-00000\.mask does not match its sha256"):
        ds[0]


def test_a_saved_hf_dataset_of_conversations_prepares_as_its_jsonl_does(deepseek_chat, chat_file, tmp_path,
                                                                         deepseek_tokenizer_dir):
    """The same conversations as a saved HF dataset (mixed formats: a column missing from a row is None there) give
    the same tokens and loss masks; a bad row is named by its row number."""
    from datasets import Dataset

    rows = [json.loads(line) for line in chat_file.read_text(encoding="utf-8").splitlines()]
    columns = {k for r in rows for k in r}  # from_list would take the first row's keys only
    Dataset.from_dict({k: [r.get(k) for r in rows] for k in sorted(columns)}).save_to_disk(str(tmp_path / "hf"))
    out = prepare_dataset([str(tmp_path / "hf")], str(tmp_path / "ds"), tokenizer_dir=deepseek_tokenizer_dir,
                          valid_fraction=0.1, shard_mb=SHARD_MB, progress=False, data_format="chat")
    ours, theirs = sorted(Path(out).glob("*-*.[bm]*")), sorted(Path(deepseek_chat).glob("*-*.[bm]*"))
    assert [p.name for p in ours] == [p.name for p in theirs] and ours
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(ours, theirs))  # .bin tokens, .mask loss masks
    Dataset.from_list([rows[1], {"messages": [{"role": "bot", "content": "x"}]}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"bad row 1: message 0: unknown role 'bot'"):
        prepare_dataset([str(tmp_path / "bad")], str(tmp_path / "ds2"), tokenizer_dir=deepseek_tokenizer_dir,
                        progress=False, data_format="chat")


def _train_lengths(chat_file, deepseek_tokenizer_dir) -> list[int]:
    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    return [len(x) for x, _ in _expected(tok, chat_file, split_rows(N_CONVERSATIONS, 0.1, 0)["train"], "all")]


def test_a_seq_len_that_drops_most_samples_is_refused_and_cut_or_few_are_noted(deepseek_chat, chat_file, tmp_path,
                                                                                  deepseek_tokenizer_dir, capsys):
    lengths = sorted(_train_lengths(chat_file, deepseek_tokenizer_dir))
    n = len(lengths)

    def config(seq_len, *sets):
        cfg = load_run_config("recipes/tiny-v3.yaml", [f"data.path={deepseek_chat}", f"data.seq_len={seq_len}",
                                                       "model.overrides.vocab_size=129280", "eval.interval=0", *sets])
        return cfg, load_ds_config(cfg.deepspeed_config)

    most = lengths[n // 3]  # about two thirds of the samples are longer
    long = sum(x > most for x in lengths)
    assert long * 2 > n and long < n
    share = rf"{long} of {n} \({long / n:.0%}\) chat samples of its train split are longer than data.seq_len {most} "
    refused(*config(most, "data.packing=true"), world=2,
            match=share + rf"\(shortest: {lengths[0]}, longest: {lengths[-1]} tokens; .*\), so data.truncation: drop "
                          "drops them: raise data.seq_len or set data.truncation: truncate_right")
    # Cutting them is what data.truncation asks for: validate passes, and says how many it cuts.
    validate(*config(most, "data.truncation=truncate_left"), 2, cuda_available=False)
    assert dataset_option_notes(deepseek_chat, config(most, "data.truncation=truncate_left")[0].data) == [
        f"data.path {deepseek_chat!r}: {long} of {n} ({long / n:.0%}) chat samples of its train split are longer "
        f"than data.seq_len {most} (shortest: {lengths[0]}, longest: {lengths[-1]} tokens; "
        f"{int(np.quantile(lengths, 0.9, method='higher'))} fits 90% of them): they are cut (truncate_left)"]
    # A few longer samples pass, and `validate` says how many and what happens to them.
    few = lengths[-3]
    cut = sum(x > few for x in lengths)
    assert 0 < cut * 2 <= n
    validate(*config(few, "data.packing=true"), 2, cuda_available=False)
    assert cli(["validate", "--config", "recipes/tiny-v3.yaml", "--num_gpus", "2", "--set", f"data.path={deepseek_chat}",
                "--set", f"data.seq_len={few}", "--set", "model.overrides.vocab_size=129280", "--set",
                "eval.interval=0", "--set", "data.packing=true", "--set", f"train.output_dir={tmp_path / 'run'}"]) == 0
    assert (f"note: data.path {deepseek_chat!r}: {cut} of {n} ({cut / n:.0%}) chat samples of its train split are "
            f"longer than data.seq_len {few}") in capsys.readouterr().out
    ds = ChatDataset(deepseek_chat, few, packing=True)
    assert f"{cut} dropped as longer than seq_len ({cut / n:.0%} of the samples)" in ds.report()


def test_prepare_reports_the_conversation_lengths(chat_file, deepseek_tokenizer_dir, tmp_path, capsys):
    assert cli(["data", "prepare", "--input", str(chat_file), "--out", str(tmp_path / "ds"), "--format", "chat",
                "--tokenizer", deepseek_tokenizer_dir, "--valid-fraction", "0.1", "--no-progress"]) == 0
    lengths = np.array(_train_lengths(chat_file, deepseek_tokenizer_dir))
    assert (f"conversation lengths (train): median {int(np.median(lengths))}, 90% within "
            f"{int(np.quantile(lengths, 0.9, method='higher'))}, longest {lengths.max()} tokens") in capsys.readouterr().out


def test_dump_prints_each_sequence_once_however_many_are_asked_for(deepseek_chat, capsys):
    options = SimpleNamespace(seq_len=4096, packing=True, truncation="drop", document_mask=False)
    packed = open_dataset(deepseek_chat, options)
    assert len(packed) == 1  # every conversation fits one sequence
    assert cli(["data", "dump", "--data", deepseek_chat, "--seq-len", "4096", "--packing", "--count", "100"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["input_ids"] for line in out.splitlines()] == [packed[0][0].tolist()]
    assert "the train split holds 1 sequences of --seq-len 4096" in err and "printing the 1 left of --start 0's" in err
    # Unpacked, every sample is a sequence: 100 asked of 36 prints the 36, each once, in order.
    one = open_dataset(deepseek_chat, SimpleNamespace(seq_len=512, packing=False, truncation="drop",
                                                      document_mask=False))
    assert cli(["data", "dump", "--data", deepseek_chat, "--seq-len", "512", "--count", "100"]) == 0
    rows = [json.loads(line)["input_ids"] for line in capsys.readouterr().out.splitlines()]
    assert rows == [one[i][0].tolist() for i in range(len(one))] and len({tuple(r) for r in rows}) == len(one) == 36
    # From --start 30: the 6 left of that epoch, the tail of the whole dump, not a wrap into the next epoch.
    assert cli(["data", "dump", "--data", deepseek_chat, "--seq-len", "512", "--count", "100", "--start", "30"]) == 0
    assert [json.loads(line)["input_ids"] for line in capsys.readouterr().out.splitlines()] == rows[30:]
    assert cli(["data", "dump", "--data", deepseek_chat, "--seq-len", "512", "--count", "30", "--start", "3"]) == 0
    assert [json.loads(line)["input_ids"] for line in capsys.readouterr().out.splitlines()] == [
        one[i][0].tolist() for i in range(3, 33)]
