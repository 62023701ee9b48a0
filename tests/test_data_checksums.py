"""Lazy shard checksums: opening a dataset hashes nothing, the first read from a shard hashes that shard only, and a
corrupted byte raises DataError (naming the file and the fix) before any sample of its shard is returned."""

from pathlib import Path

import numpy as np
import pytest

from deepseek_ds.data import DataError, PackedDataset, dataset_info, layout, prepare_dataset

pytestmark = pytest.mark.unit

SEQ_LEN = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("checksums")
    (root / "in").mkdir()
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "class", "λ", "数据"]
    for i in range(8):
        (root / "in" / f"doc_{i}.txt").write_text(" ".join(rng.choice(words, size=800)) + "\n", encoding="utf-8")
    return prepare_dataset([str(root / "in")], str(root / "ds"), vocab_size=300, valid_fraction=0.0, shard_mb=0.004,
                           progress=False)


def _shards(path: str) -> list[dict]:
    return dataset_info(path)["splits"]["train"]["shards"]


def _first_sample_of(path: str, k: int) -> int:
    """Index of the first sample whose tokens all lie in shard k."""
    start = sum(s["num_tokens"] for s in _shards(path)[:k])
    return -(-start // SEQ_LEN)


def _corrupt(dataset: str, tmp_path: Path, name: str) -> str:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in Path(dataset).iterdir():
        if f.is_file():
            data = f.read_bytes()
            if f.name == name:
                data = bytes([data[0] ^ 0xFF]) + data[1:]  # same size: only the checksum can tell
            (copy / f.name).write_bytes(data)
    (copy / "tokenizer").symlink_to(Path(dataset) / "tokenizer")
    return str(copy)


def test_only_the_shards_read_are_hashed(dataset, monkeypatch):
    assert len(_shards(dataset)) >= 4
    hashed = []
    real = layout.file_sha256
    monkeypatch.setattr(layout, "file_sha256", lambda path: hashed.append(Path(path).name) or real(path))
    ds = PackedDataset(dataset, SEQ_LEN)
    assert hashed == []  # opening costs stat calls only
    name2 = _shards(dataset)[2]["name"]
    first2 = _first_sample_of(dataset, 2)
    ds[first2]
    ds[first2 + 1]  # the same shard again: hashed once
    assert hashed == [f"{name2}.bin", f"{name2}.idx"]
    # A sample that straddles shards 0 and 1 verifies both before returning.
    last0 = _first_sample_of(dataset, 1) - 1
    ds[last0]
    names = [s["name"] for s in _shards(dataset)]
    assert sorted(hashed) == sorted(f"{n}.{ext}" for n in (names[0], names[1], name2) for ext in ("bin", "idx"))
    assert not [h for h in hashed if h.startswith(names[3])]  # untouched shards are never read


def test_a_flipped_byte_is_caught_at_the_first_read_of_its_shard(dataset, tmp_path):
    name = _shards(dataset)[3]["name"]
    copy = _corrupt(dataset, tmp_path, f"{name}.bin")
    ds = PackedDataset(copy, SEQ_LEN)  # sizes agree: open succeeds
    clean = PackedDataset(dataset, SEQ_LEN)
    before = _first_sample_of(dataset, 3) - 2  # wholly in shard 2: readable, and right
    assert np.array_equal(ds[before], clean[before])
    for _ in range(2):  # a failed check is not remembered as passed
        with pytest.raises(DataError, match=rf"{name}\.bin does not match its sha256 checksum.*corrupted.*"
                                            r"deepseek-ds data prepare"):
            ds[_first_sample_of(dataset, 3)]
    # The sample that ends in the damaged shard is refused too, not returned with a bad last token.
    with pytest.raises(DataError, match=rf"{name}\.bin"):
        ds[_first_sample_of(dataset, 3) - 1]
    assert len(PackedDataset(copy, SEQ_LEN, verify_checksums=False)[_first_sample_of(dataset, 3)]) == SEQ_LEN + 1


def test_a_flipped_byte_in_the_document_index_is_caught(dataset, tmp_path):
    name = _shards(dataset)[0]["name"]
    ds = PackedDataset(_corrupt(dataset, tmp_path, f"{name}.idx"), SEQ_LEN)
    with pytest.raises(DataError, match=rf"{name}\.idx does not match its sha256 checksum"):
        ds[0]


def test_sizes_are_still_checked_at_open(dataset, tmp_path):
    name = _shards(dataset)[1]["name"]
    copy = _corrupt(dataset, tmp_path, "none")
    victim = Path(copy) / f"{name}.bin"
    victim.write_bytes(victim.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"{name}\.bin has .* bytes but meta\.json expects .*truncated"):
        PackedDataset(copy, SEQ_LEN)
