"""Packed, memory-mapped samples of seq_len + 1 tokens, and weighted blends of several datasets.

Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1] of the split's token stream (shards in order):
samples cross document boundaries (EOS separates documents) and consecutive samples share one token,
so every token is a training label exactly once.

With document_mask a sample is an int64 array [3, seq_len] instead: input_ids, labels and position_ids, where a
document ends with its EOS (the EOS is its last input token) and position_ids restart at 0 at the token after each
EOS and at the first token of the sample (a document cut by the sample start counts from 0 there too). The label of
an EOS position, the next document's first token, is -100: that document is invisible to it.

Checksums are verified lazily: a shard's sha256 is computed the first time one of its samples is read, so
opening a dataset of any size costs a few stat calls, a rank hashes only the shards it reads, and no corrupted
byte reaches a sample (the read that would return it raises DataError instead).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import DataError
from .layout import TEXT_FORMAT, check_shard_checksums, check_shard_sizes, dataset_format, read_meta, shard_files

IGNORE_INDEX = -100  # the label the loss skips


def restarting_positions(starts: np.ndarray) -> np.ndarray:
    """Position ids counting from 0 at every True of `starts` (starts[0] must be True)."""
    index = np.arange(len(starts), dtype=np.int64)
    return index - np.maximum.accumulate(np.where(starts, index, 0))


class MappedShards:
    """A dataset over memory-mapped shard files (`_maps`, made by `_open()`). Pickling (DataLoader workers) must not
    copy the mapped data: it reopens the maps instead."""

    def _open(self) -> list:
        raise NotImplementedError

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_maps"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._maps = self._open()


class PackedDataset(MappedShards):
    """Samples of one split of a prepared dataset. Sizes are checked on open; each shard's sha256 checksums on
    the first read from it (unless verify_checksums=False). Files are memory-mapped, so RSS stays small for any
    data size. `gives_position_ids` (document_mask) says samples are [3, seq_len] arrays (see the module doc)."""

    def __init__(self, dataset_dir: str, seq_len: int, split: str = "train", *, verify_checksums: bool = True,
                 document_mask: bool = False):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        meta = read_meta(dataset_dir)
        if dataset_format(meta) != TEXT_FORMAT:
            raise DataError(f"{dataset_dir} is a {dataset_format(meta)} dataset, not a token stream: open it with "
                            f"deepseek_ds.data.open_dataset")
        if split not in meta["splits"]:
            raise DataError(f"{dataset_dir} has no split {split!r} (splits: {sorted(meta['splits'])})")
        self.dataset_dir, self.seq_len, self.split = str(dataset_dir), seq_len, split
        self._dtype, self._eos, self.gives_position_ids = meta["dtype"], meta["eos_id"], document_mask
        shards = [s for s in meta["splits"][split]["shards"] if s["num_tokens"] > 0]
        for record in shards:
            check_shard_sizes(Path(dataset_dir), record, self._dtype)
        self._records = shards
        self._unverified = set(range(len(shards))) if verify_checksums else set()
        self._paths = [str(shard_files(Path(dataset_dir), s["name"])[0]) for s in shards]
        # _starts[k] = index of shard k's first token in the split's token stream.
        self._starts = np.concatenate([[0], np.cumsum([s["num_tokens"] for s in shards])]).astype(np.int64)
        self.num_tokens = int(self._starts[-1])
        self._len = max(0, (self.num_tokens - 1) // seq_len)
        if self._len == 0:
            raise DataError(f"split {split!r} of {dataset_dir} has {self.num_tokens} tokens, fewer than one sample "
                            f"of seq_len + 1 = {seq_len + 1}: add data, lower seq_len or raise valid_fraction")
        self._maps = self._open()

    def _open(self) -> list[np.memmap]:
        return [np.memmap(p, dtype=self._dtype, mode="r") for p in self._paths]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        tokens = self.tokens(i)
        if not self.gives_position_ids:
            return tokens
        inputs, labels = tokens[:-1], tokens[1:].copy()
        ends = inputs == self._eos
        labels[ends] = IGNORE_INDEX
        return np.stack([inputs, labels, restarting_positions(np.concatenate([[True], ends[:-1]]))])

    def tokens(self, i: int) -> np.ndarray:
        """The seq_len + 1 tokens of sample i."""
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range [0, {self._len})")
        start, end = int(i) * self.seq_len, int(i) * self.seq_len + self.seq_len + 1
        out = np.empty(end - start, np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < end:  # a sample may span several shards
            take = min(end, int(self._starts[k + 1])) - pos
            local = pos - int(self._starts[k])
            out[pos - start:pos - start + take] = self._verified_map(k)[local:local + take]
            pos += take
            k += 1
        return out

    def _verified_map(self, k: int) -> np.memmap:
        if k in self._unverified:
            check_shard_checksums(Path(self.dataset_dir), self._records[k])
            self._unverified.discard(k)
        return self._maps[k]
