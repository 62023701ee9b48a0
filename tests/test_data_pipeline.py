"""Data preparation, packed datasets, tokenizers, errors and the data CLI on a tiny corpus."""

import concurrent.futures
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from deepseek_ds.data import (
    DataError,
    PackedDataset,
    dataset_info,
    ensure_builtin_dataset,
    load_tokenizer,
    prepare_dataset,
)
from deepseek_ds.data import shards as shards_module
from deepseek_ds.data.builtin import stdlib_files
from deepseek_ds.data.tokenizer import token_dtype
from helpers import cli

pytestmark = pytest.mark.unit

VOCAB = 400
SHARD_MB = 0.01  # ~10 KB of text per shard: the tiny corpus still has several shards


def _doc(i: int) -> str:
    words = ["def", "return", "self", "value", "héllo", "wörld", "数据", "✓", "import", "class", "λ"]
    rng = np.random.default_rng(i)
    lines = [" ".join(rng.choice(words, size=rng.integers(3, 12))) for _ in range(rng.integers(20, 120))]
    return f"# document {i}\n" + "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """Text files in a directory tree (one empty), a JSON Lines file, and their documents in corpus order."""
    root = tmp_path_factory.mktemp("corpus")
    texts = root / "texts"
    (texts / "sub").mkdir(parents=True)
    docs = []
    for i in range(12):
        (texts / f"doc_{i:02d}.txt").write_text(_doc(i), encoding="utf-8")
        docs.append(_doc(i))
    (texts / "empty.txt").write_text("")  # sorts first; contributes nothing
    for i in range(12, 16):
        (texts / "sub" / f"doc_{i:02d}.txt").write_text(_doc(i), encoding="utf-8")
        docs.append(_doc(i))
    jsonl = root / "records.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for i in range(16, 24):
            f.write(json.dumps({"id": i, "body": _doc(i)}) + "\n\n")  # blank lines are skipped
            docs.append(_doc(i))
    return {"inputs": [str(texts), str(jsonl)], "docs": docs, "root": root}


@pytest.fixture(scope="session")
def dataset(corpus, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("ds") / "one_worker"
    return prepare_dataset(corpus["inputs"], str(out), vocab_size=VOCAB, workers=1, jsonl_field="body",
                           valid_fraction=0.1, seed=0, shard_mb=SHARD_MB, progress=False)


def _tree(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def test_two_workers_via_cli_are_byte_identical(corpus, dataset, tmp_path):
    out = tmp_path / "two_workers"
    argv = ["prepare", "--input", *corpus["inputs"], "--out", str(out), "--vocab-size", str(VOCAB), "--workers", "2",
            "--jsonl-field", "body", "--valid-fraction", "0.1", "--shard-mb", str(SHARD_MB), "--no-progress"]
    assert cli(["data", *argv]) == 0
    assert len(dataset_info(dataset)["splits"]["train"]["shards"]) >= 4
    one, two = _tree(dataset), _tree(str(out))
    assert sorted(one) == sorted(two)
    assert all(one[name] == two[name] for name in one)


def test_metadata_counts_and_validation_split(corpus, dataset):
    info = dataset_info(dataset)
    tok = load_tokenizer(dataset)
    # A tiny corpus runs out of merges before the requested size: metadata reports the real size.
    assert 257 < info["vocab_size"] == len(tok) <= VOCAB and info["dtype"] == "uint16"
    assert info["eos_id"] == tok.eos_token_id and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"
    train, valid = info["splits"]["train"], info["splits"]["valid"]
    assert train["num_docs"] + valid["num_docs"] == info["num_docs"] == len(corpus["docs"])
    assert valid["num_docs"] == 2  # 10% of 24 documents (the empty file is never a document)
    assert info["num_tokens"] == train["num_tokens"] + valid["num_tokens"]
    assert len(PackedDataset(dataset, 32, split="valid")) > 0


def test_packing_equals_concatenated_documents_with_eos(corpus, dataset, tmp_path):
    # The trained tokenizer imported from a directory; no validation split, so all documents are in order.
    tok_dir = str(Path(dataset) / "tokenizer")
    out = prepare_dataset(corpus["inputs"], str(tmp_path / "all"), tokenizer_dir=tok_dir, jsonl_field="body",
                          valid_fraction=0.0, shard_mb=SHARD_MB, progress=False)
    tok = load_tokenizer(out)
    ids = [tok.encode(d, add_special_tokens=False) for d in corpus["docs"]]
    expected = np.concatenate([np.array(d + [tok.eos_token_id]) for d in ids])
    seq_len = 50
    ds = PackedDataset(out, seq_len)
    assert len(ds) == (len(expected) - 1) // seq_len
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.dtype == np.int64 and len(sample) == seq_len + 1
        assert np.array_equal(sample, expected[i * seq_len:(i + 1) * seq_len + 1]), i
    # The document index: boundaries of every document, shard by shard.
    bounds = [np.fromfile(Path(out) / f"{s['name']}.idx", dtype="<i8")
              for s in dataset_info(out)["splits"]["train"]["shards"]]
    lengths = np.concatenate([np.diff(b) for b in bounds])
    assert lengths.tolist() == [len(d) + 1 for d in ids]


def test_rerun_skips_finished_shards_and_resumes_after_a_kill(corpus, dataset, tmp_path, monkeypatch):
    out = tmp_path / "killed"
    real_write = shards_module.write_shard
    written = []

    def dies_on_third_shard(task):
        if len(written) == 2:
            raise KeyboardInterrupt("killed")
        written.append(task.name)
        return real_write(task)

    monkeypatch.setattr("deepseek_ds.data.prepare.write_shard", dies_on_third_shard)
    kwargs = dict(vocab_size=VOCAB, jsonl_field="body", valid_fraction=0.1, shard_mb=SHARD_MB, progress=False)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(corpus["inputs"], str(out), **kwargs)
    assert not (out / "meta.json").exists()
    with pytest.raises(DataError, match="not a prepared dataset"):
        PackedDataset(str(out), 16)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    assert len(mtimes) == 2

    written.clear()
    monkeypatch.setattr("deepseek_ds.data.prepare.write_shard", lambda t: written.append(t.name) or real_write(t))
    prepare_dataset(corpus["inputs"], str(out), **kwargs)
    total = len(dataset_info(str(out))["splits"]["train"]["shards"]) + 1
    assert len(written) == total - 2 and not set(written) & set(mtimes)
    assert {n: (out / n).stat().st_mtime_ns for n in mtimes} == mtimes
    assert _tree(str(out)) == _tree(dataset)  # no temporaries left, same bytes as an uninterrupted run

    written.clear()
    prepare_dataset(corpus["inputs"], str(out), **kwargs)  # finished: nothing rebuilt
    assert written == []


def test_racing_preparers_agree(corpus, dataset, tmp_path):
    out = str(tmp_path / "raced")
    run = lambda _: prepare_dataset(corpus["inputs"], out, vocab_size=VOCAB, jsonl_field="body", valid_fraction=0.1,
                                    shard_mb=SHARD_MB, progress=False)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(run, range(2))) == [out, out]
    assert _tree(out) == _tree(dataset)


def _damaged_copy(dataset: str, tmp_path: Path) -> tuple[str, Path]:
    copy = str(tmp_path / "copy")
    shutil.copytree(dataset, copy)
    return copy, Path(copy) / "train-00001.bin"


def test_truncated_token_file(dataset, tmp_path, corpus):
    copy, victim = _damaged_copy(dataset, tmp_path)
    victim.write_bytes(victim.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"train-00001\.bin.*truncated.*prepare"):
        PackedDataset(copy, 16)
    # The fix the message gives works: the same prepare command rebuilds just that shard.
    prepare_dataset(corpus["inputs"], copy, vocab_size=VOCAB, jsonl_field="body", valid_fraction=0.1,
                    shard_mb=SHARD_MB, progress=False)
    assert len(PackedDataset(copy, 16)) == len(PackedDataset(dataset, 16))


def test_mismatched_tokenizer(corpus, dataset, tmp_path):
    other = prepare_dataset([str(Path(corpus["inputs"][0]) / "sub")], str(tmp_path / "other"), vocab_size=300,
                            valid_fraction=0.0, progress=False)
    copy, _ = _damaged_copy(dataset, tmp_path)
    shutil.rmtree(Path(copy) / "tokenizer")
    shutil.copytree(Path(other) / "tokenizer", Path(copy) / "tokenizer")
    with pytest.raises(DataError, match=r"tokenizer.*does not match.*meta\.json"):
        load_tokenizer(copy)
    # Preparing into an existing dataset with another tokenizer is refused, not mixed.
    with pytest.raises(DataError, match=r"already holds a dataset prepared with different \['tokenizer'\]"):
        prepare_dataset(corpus["inputs"], dataset, tokenizer_dir=str(Path(other) / "tokenizer"), jsonl_field="body",
                        valid_fraction=0.1, shard_mb=SHARD_MB, progress=False)


def test_empty_input(tmp_path):
    (tmp_path / "in").mkdir()
    with pytest.raises(DataError, match="no text found"):
        prepare_dataset([str(tmp_path / "in")], str(tmp_path / "out"), progress=False)
    (tmp_path / "in" / "blank.txt").write_text("")
    with pytest.raises(DataError, match="no text found"):
        prepare_dataset([str(tmp_path / "in")], str(tmp_path / "out"), progress=False)
    with pytest.raises(DataError, match="does not exist"):
        prepare_dataset([str(tmp_path / "missing")], str(tmp_path / "out"), progress=False)


@pytest.mark.parametrize("workers", [1, 2])
def test_non_utf8_file(tmp_path, workers):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "good.txt").write_text("plain text " * 50)
    (tmp_path / "in" / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    tok_dir = tmp_path / "tok"
    (tmp_path / "tok_src").mkdir()
    (tmp_path / "tok_src" / "a.txt").write_text("plain text " * 50)
    prepare_dataset([str(tmp_path / "tok_src")], str(tok_dir), vocab_size=300, valid_fraction=0.0, progress=False)
    # With a ready tokenizer the bad file is met inside a worker process: the error still arrives intact.
    with pytest.raises(DataError, match=r"latin1\.txt is not valid UTF-8.*iconv"):
        prepare_dataset([str(tmp_path / "in")], str(tmp_path / "out"), tokenizer_dir=str(tok_dir / "tokenizer"),
                        workers=workers, valid_fraction=0.0, shard_mb=1e-5, progress=False)
    # Training a tokenizer reads every document first, so the error comes before any tokenizing.
    with pytest.raises(DataError, match=r"latin1\.txt is not valid UTF-8.*iconv"):
        prepare_dataset([str(tmp_path / "in")], str(tmp_path / "out2"), vocab_size=300, valid_fraction=0.0,
                        progress=False)


def test_jsonl_without_the_field(tmp_path):
    (tmp_path / "r.jsonl").write_text(json.dumps({"body": "text"}) + "\n")
    with pytest.raises(DataError, match=r"r\.jsonl.*no string field 'text'.*jsonl-field"):
        prepare_dataset([str(tmp_path / "r.jsonl")], str(tmp_path / "out"), vocab_size=300, progress=False)


def test_hf_dataset_input(tmp_path):
    from datasets import Dataset

    texts = [_doc(i) for i in range(6)]
    Dataset.from_dict({"content": texts}).save_to_disk(str(tmp_path / "hf"))
    out = prepare_dataset([str(tmp_path / "hf")], str(tmp_path / "out"), vocab_size=300, jsonl_field="content",
                          valid_fraction=0.0, progress=False)
    tok = load_tokenizer(out)
    expected = [t for d in texts for t in tok.encode(d, add_special_tokens=False) + [tok.eos_token_id]]
    ds = PackedDataset(out, len(expected) - 1)
    assert ds[0].tolist() == expected


def test_dump_prints_training_order(dataset, capsys):
    assert cli(["data", "dump", "--data", dataset, "--seq-len", "8", "--start", "3", "--count", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ds = PackedDataset(dataset, 8)
    assert [json.loads(line) for line in lines] == [ds[3].tolist(), ds[4].tolist()]


def test_cli_reports_data_errors(tmp_path, capsys):
    assert cli(["data", "dump", "--data", str(tmp_path), "--seq-len", "8"]) == 2
    assert "not a prepared dataset" in capsys.readouterr().err


def _private_rss_mb() -> float:
    # Anonymous (private) resident memory. Mapped file pages count in VmRSS too, but they are clean page
    # cache the kernel drops under pressure: data loaded into the process would show up here instead.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_memory_mapped_reading_keeps_rss_small(dataset, tmp_path):
    # A 96 MB shard in place of the real ones; samples read from it must not load it into memory.
    copy, _ = _damaged_copy(dataset, tmp_path)
    meta = json.loads((Path(copy) / "meta.json").read_text())
    big = np.random.default_rng(0).integers(0, VOCAB, 48 * 2**20, dtype=np.uint16)
    big.tofile(Path(copy) / "train-00000.bin")
    del big
    import hashlib
    record = meta["splits"]["train"]["shards"][0]
    record["num_tokens"] = 48 * 2**20
    record["bin_sha256"] = hashlib.sha256((Path(copy) / "train-00000.bin").read_bytes()).hexdigest()
    meta["splits"]["train"]["shards"] = [record]
    (Path(copy) / "meta.json").write_text(json.dumps(meta))
    before = _private_rss_mb()
    ds = PackedDataset(copy, 1024)
    firsts = [int(ds[i][0]) for i in range(0, len(ds), 7)]  # hashes the file (in chunks), then touches every page
    assert len(ds) == (48 * 2**20 - 1) // 1024 and len(firsts) > 7000
    assert _private_rss_mb() - before < 40  # reading the file into memory would add 96 MB


def test_packed_dataset_pickles_without_copying_data(dataset):
    ds = PackedDataset(dataset, 16)
    blob = pickle.dumps(ds)  # what a DataLoader worker receives
    assert len(blob) < 4096
    assert np.array_equal(pickle.loads(blob)[len(ds) - 1], ds[len(ds) - 1])


def test_builtin_corpus(tmp_path):
    files = stdlib_files(0.3)
    assert files == sorted(files, key=lambda f: Path(f).as_posix()) and files
    assert not any(set(Path(f).parts) & {"test", "tests", "site-packages"} for f in files)
    assert sum(os.path.getsize(f) for f in files) <= 0.3 * 2**20
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: ensure_builtin_dataset(str(tmp_path), vocab_size=512, max_mb=0.3,
                                                               progress=False), range(2)))
    assert paths[0] == paths[1] == str(tmp_path / "stdlib-v512-0.3mb")
    meta_mtime = (Path(paths[0]) / "meta.json").stat().st_mtime_ns
    assert ensure_builtin_dataset(str(tmp_path), vocab_size=512, max_mb=0.3, progress=False) == paths[0]
    assert (Path(paths[0]) / "meta.json").stat().st_mtime_ns == meta_mtime
    tok = load_tokenizer(paths[0])
    assert len(tok) == dataset_info(paths[0])["vocab_size"] == 512 and tok.eos_token_id is not None
    assert tok.decode(PackedDataset(paths[0], 64)[0]).startswith(Path(files[0]).read_text()[:40])


def test_token_dtype_follows_vocabulary():
    assert token_dtype(2**16) == "uint16" and token_dtype(2**16 + 1) == "uint32"
