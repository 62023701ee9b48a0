"""Chat (SFT) samples as fixed-length training sequences, and `open_dataset`: the one way a run opens a split.

A chat dataset stores each conversation as one sample: its tokens and, per token, whether the loss is computed on
it (layout.py). A sequence of seq_len positions is an int64 array [3, seq_len]: input_ids, labels (already shifted:
labels[i] is the target of position i, -100 = no loss) and position_ids. Each sample of n tokens takes n positions;
labels[i] is token i + 1 when that token is trained, and its last position predicts nothing (-100). position_ids
count 0..n-1 within each sample, so a mask built from them (a new sample wherever position_ids == 0) keeps samples
apart. The padding after the last sample is EOS ids with label -100 and its own run of positions from 0.

With packing, whole samples are placed first-fit in order: each goes into the first sequence with room for it,
else opens a new one. Without, each sample is one sequence. A sample longer than seq_len is dropped, or cut to its
first (truncate_right) or last (truncate_left) seq_len tokens, never split across sequences; `counts` and
`report()` say how many.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import DataError
from .layout import (
    CHAT_FORMAT,
    META,
    PREFERENCE_FORMAT,
    PROMPTS_FORMAT,
    TEXT_FORMAT,
    TRAINED_FORMATS,
    check_shard_checksums,
    check_shard_sizes,
    dataset_format,
    mask_file,
    read_meta,
    shard_files,
)
from .packed import IGNORE_INDEX, MappedShards, PackedDataset
from .prompts import PromptDataset

TRUNCATE_LEFT, TRUNCATE_RIGHT, DROP = "truncate_left", "truncate_right", "drop"


def chat_sample_lengths(dataset_dir: str, split: str) -> np.ndarray:
    """Tokens of every sample of a chat dataset's split, in order (reads only the .idx files)."""
    meta = read_meta(dataset_dir)
    lengths = [np.diff(np.fromfile(shard_files(Path(dataset_dir), s["name"])[1], dtype="<i8"))
               for s in meta["splits"].get(split, {}).get("shards", []) if s["num_docs"] > 0]
    return np.concatenate(lengths) if lengths else np.empty(0, np.int64)


def first_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Sample indices per sequence: each sample, in order, goes into the first sequence with room for it."""
    sequences: list[list[int]] = []
    room = np.empty(0, np.int64)
    for j, n in enumerate(lengths.tolist()):
        fits = np.flatnonzero(room >= n)
        if len(fits):
            sequences[fits[0]].append(j)
            room[fits[0]] -= n
        else:
            sequences.append([j])
            room = np.append(room, capacity - n)
    return sequences


class ChatDataset(MappedShards):
    """Sequences of one split of a chat dataset (module doc). Sizes are checked on open; each shard's checksums on
    the first read from it. Files are memory-mapped."""

    gives_position_ids = True

    def __init__(self, dataset_dir: str, seq_len: int, split: str = "train", *, packing: bool = False,
                 truncation: str = DROP, verify_checksums: bool = True):
        if truncation not in (DROP, TRUNCATE_LEFT, TRUNCATE_RIGHT):
            raise DataError(f"truncation {truncation!r}: use {DROP}, {TRUNCATE_LEFT} or {TRUNCATE_RIGHT}")
        meta = read_meta(dataset_dir)
        if dataset_format(meta) not in TRAINED_FORMATS:
            raise DataError(f"{dataset_dir} is not a chat dataset: prepare it with `deepseek-ds data prepare "
                            f"--format chat`")
        self.dataset_dir, self.seq_len, self.split = str(dataset_dir), seq_len, split
        self.packing, self.truncation = packing, truncation
        self._dtype, self._pad = meta["dtype"], meta["eos_id"]
        self._records = [s for s in meta["splits"][split]["shards"] if s["num_docs"] > 0]
        root = Path(dataset_dir)
        for record in self._records:
            check_shard_sizes(root, record, self._dtype)
        self._unverified = set(range(len(self._records))) if verify_checksums else set()
        self._maps = self._open()
        # Every sample: (shard, first token, tokens) before truncation.
        shard, start, length = [], [], []
        for k, record in enumerate(self._records):
            bounds = np.fromfile(shard_files(root, record["name"])[1], dtype="<i8")
            shard.append(np.full(len(bounds) - 1, k, np.int64))
            start.append(bounds[:-1])
            length.append(np.diff(bounds))
        shard, start, length = (np.concatenate(a) if a else np.empty(0, np.int64) for a in (shard, start, length))
        long = length > seq_len
        if truncation == TRUNCATE_LEFT:
            start = np.where(long, start + length - seq_len, start)
        keep = ~long if truncation == DROP else np.ones(len(length), bool)
        self._shard, self._start, self._length = shard[keep], start[keep], np.minimum(length, seq_len)[keep]
        sequences = (first_fit(self._length, seq_len) if packing else [[j] for j in range(len(self._length))])
        self._members = np.array([j for seq in sequences for j in seq], np.int64)
        self._offsets = np.concatenate([[0], np.cumsum([len(seq) for seq in sequences])]).astype(np.int64)
        self.counts = {"samples": len(length), "truncated": 0 if truncation == DROP else int(long.sum()),
                       "dropped": int(long.sum()) if truncation == DROP else 0, "sequences": len(sequences)}
        if not sequences:
            raise DataError(f"split {split!r} of {dataset_dir}: all {len(length)} chat samples are longer than "
                            f"seq_len {seq_len} and truncation is drop: raise data.seq_len (longest sample: "
                            f"{int(length.max()) if len(length) else 0} tokens) or set data.truncation")

    def report(self) -> str:
        """One line: samples, sequences, truncated and dropped counts (and their share of the samples)."""
        c = self.counts
        how = "packed" if self.packing else "one sample each"
        cut = c["truncated"] + c["dropped"]
        share = f" ({cut / c['samples']:.0%} of the samples)" if cut else ""
        return (f"chat data ({self.split}): {c['samples']:,} samples -> {c['sequences']:,} sequences of {self.seq_len}"
                f" tokens ({how}); {c['truncated']:,} truncated, {c['dropped']:,} dropped as longer than seq_len"
                f"{share} (data.truncation: {self.truncation})")

    def _open(self) -> list[tuple[np.memmap, np.memmap]]:
        root = Path(self.dataset_dir)
        return [(np.memmap(shard_files(root, r["name"])[0], dtype=self._dtype, mode="r"),
                 np.memmap(mask_file(root, r["name"]), dtype=np.uint8, mode="r")) for r in self._records]

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        out = np.empty((3, self.seq_len), np.int64)
        inputs, labels, positions = out
        labels[:] = IGNORE_INDEX
        at = 0
        for j in self._members[self._offsets[i]:self._offsets[i + 1]]:
            k, a, n = int(self._shard[j]), int(self._start[j]), int(self._length[j])
            tokens, trained = self._verified_maps(k)
            ids = tokens[a:a + n].astype(np.int64)
            inputs[at:at + n] = ids
            labels[at:at + n - 1] = np.where(trained[a + 1:a + n] == 1, ids[1:], IGNORE_INDEX)
            positions[at:at + n] = np.arange(n)
            at += n
        inputs[at:] = self._pad
        positions[at:] = np.arange(self.seq_len - at)
        return out

    def _verified_maps(self, k: int) -> tuple[np.memmap, np.memmap]:
        if k in self._unverified:
            check_shard_checksums(Path(self.dataset_dir), self._records[k])
            self._unverified.discard(k)
        return self._maps[k]


class PreferenceDataset:
    """Pairs of one split of a preference dataset: item k is an int64 array [2, 3, seq_len], pair k's chosen and
    rejected sequences as ChatDataset makes them (one sample a sequence: pairs are never packed). A pair with a side
    longer than seq_len is dropped whole (truncation drop), or its long sides are cut (truncate_left/right);
    `counts` and `report()` say how many."""

    gives_position_ids = True
    pairs = True  # sampler.micro_batch: a micro-batch of B pairs is 2B rows, the B chosen ones first

    def __init__(self, dataset_dir: str, seq_len: int, split: str = "train", *, truncation: str = DROP,
                 verify_checksums: bool = True):
        if dataset_format(read_meta(dataset_dir)) != PREFERENCE_FORMAT:
            raise DataError(f"{dataset_dir} is not a preference dataset: prepare it with `deepseek-ds data prepare "
                            "--format preference`")
        self.dataset_dir, self.seq_len, self.split, self.truncation = str(dataset_dir), seq_len, split, truncation
        long = (chat_sample_lengths(dataset_dir, split).reshape(-1, 2) > seq_len).any(1)
        # Every sample kept (cut where it must be), so sequence j is sample j and pair k is sequences 2k and 2k + 1.
        self._sequences = ChatDataset(dataset_dir, seq_len, split, verify_checksums=verify_checksums,
                                      truncation=TRUNCATE_RIGHT if truncation == DROP else truncation)
        self.pair_ids = np.flatnonzero(~long) if truncation == DROP else np.arange(len(long))
        cut = int(long.sum())
        self.counts = {"pairs": len(long), "dropped": cut if truncation == DROP else 0,
                       "truncated": 0 if truncation == DROP else cut}
        if not len(self.pair_ids):
            raise DataError(f"split {split!r} of {dataset_dir}: all {len(long)} pairs have a side longer than seq_len "
                            f"{seq_len} and truncation is drop: raise data.seq_len or set data.truncation")

    def report(self) -> str:
        c = self.counts
        return (f"preference data ({self.split}): {c['pairs']:,} pairs, two sequences of {self.seq_len} tokens each; "
                f"{c['truncated']:,} truncated, {c['dropped']:,} dropped as longer than seq_len "
                f"(data.truncation: {self.truncation})")

    def __len__(self) -> int:
        return len(self.pair_ids)

    def __getitem__(self, k: int) -> np.ndarray:
        p = int(self.pair_ids[k])
        return np.stack([self._sequences[2 * p], self._sequences[2 * p + 1]])


def dataset_option_errors(dataset_dir: str, meta: dict, options, splits: tuple[str, ...] = ("train",)) -> list[str]:
    """What `options` (data.seq_len / packing / truncation) cannot do with these splits of the dataset, one line
    each; [] for a prompts dataset, whose prompts are generated from (their lengths are the objective's business)."""
    if dataset_format(meta) == PROMPTS_FORMAT:
        return []
    if dataset_format(meta) == TEXT_FORMAT:
        errors = []
        if options.packing:
            errors.append(f"data.packing is for chat datasets; {dataset_dir} is raw text, always one packed stream: "
                          "remove data.packing (data.document_mask keeps its documents apart)")
        if options.truncation != DROP:
            errors.append(f"data.truncation = {options.truncation} is for chat datasets; {dataset_dir} is raw text, "
                          "whose documents are never truncated: remove data.truncation")
        return errors
    errors = []
    for split in splits:
        lengths = chat_sample_lengths(dataset_dir, split)
        long = int((lengths > options.seq_len).sum())
        # Dropping more than half of the training samples is a seq_len chosen for other data, not a few outliers; a
        # small validation split is refused only when nothing of it is left. Cutting them (data.truncation) is what
        # the user asked for: a note (dataset_option_notes), not an error.
        limit = len(lengths) // 2 if split == "train" else len(lengths) - 1
        if not len(lengths) or options.truncation != DROP or long <= limit:
            continue
        what = _too_long(dataset_dir, split, lengths, options.seq_len)
        errors.append(f"{what}, so data.truncation: drop {'leaves nothing' if long == len(lengths) else 'drops them'}"
                      ": raise data.seq_len or set data.truncation: truncate_right (or truncate_left)")
    return errors


def _too_long(dataset_dir: str, split: str, lengths: np.ndarray, seq_len: int) -> str:
    """'data.path ...: K of N (P%) chat samples of its SPLIT split are longer than data.seq_len S (...)'."""
    long = int((lengths > seq_len).sum())
    count = f"all {len(lengths):,}" if long == len(lengths) else f"{long:,} of {len(lengths):,} ({long / len(lengths):.0%})"
    fits = int(np.quantile(lengths, 0.9, method="higher"))
    return (f"data.path {dataset_dir!r}: {count} chat samples of its {split} split are longer than data.seq_len "
            f"{seq_len} (shortest: {int(lengths.min())}, longest: {int(lengths.max())} tokens; {fits} fits 90% of "
            "them)")


def dataset_option_notes(dataset_dir: str, options, splits: tuple[str, ...] = ("train",)) -> list[str]:
    """One line per split of a chat dataset where some samples are longer than data.seq_len (and
    dataset_option_errors lets it pass): how many, and what data.truncation does with them; [] for raw text or when
    all fit."""
    if not dataset_dir or not (Path(dataset_dir) / META).is_file() or dataset_format(read_meta(dataset_dir)) not in TRAINED_FORMATS:
        return []
    notes = []
    for split in splits:
        lengths = chat_sample_lengths(dataset_dir, split)
        if len(lengths) and (lengths > options.seq_len).any():
            fate = "dropped" if options.truncation == DROP else f"cut ({options.truncation})"
            notes.append(f"{_too_long(dataset_dir, split, lengths, options.seq_len)}: they are {fate}")
    return notes


def open_dataset(dataset_dir: str, options, split: str = "train"):
    """A split as training sequences, chosen by the dataset's format: PackedDataset for raw text (with
    options.document_mask), ChatDataset for chat data (options.packing, options.truncation); a prompts dataset as its
    PromptDataset (prompts, not sequences: the options do not apply). `options` is a DataSection, or anything with
    its seq_len, packing, truncation and document_mask fields."""
    meta = read_meta(dataset_dir)
    if dataset_format(meta) == PROMPTS_FORMAT:
        return PromptDataset(dataset_dir, split)
    errors = dataset_option_errors(dataset_dir, meta, options, (split,))
    if errors:
        raise DataError(errors[0])
    if dataset_format(meta) == PREFERENCE_FORMAT:
        return PreferenceDataset(dataset_dir, options.seq_len, split, truncation=options.truncation)
    if dataset_format(meta) == CHAT_FORMAT:
        return ChatDataset(dataset_dir, options.seq_len, split, packing=options.packing,
                           truncation=options.truncation)
    return PackedDataset(dataset_dir, options.seq_len, split, document_mask=options.document_mask)
