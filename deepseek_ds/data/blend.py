"""Weighted blends of prepared datasets: one global order that interleaves the sources by weight, each source's own
samples in its own seeded order, epochs of a small source wrapping (and counted) inside the blend.

Position p of the blend holds draw k of source i, where the draws of all sources are sorted by their "times"
(k + 1/2) / w_i, ties going to the lower source index: stride scheduling, the Sainte-Laguë divisor order. For any
prefix of n positions the count c_i of source i satisfies |c_i - w_i n| <= (1 - w_i + w_i (S - 1)) / 2, under 1 sample
for 2 or 3 sources (Megatron's BlendedDataset takes the source furthest behind its share, greedily, in an index it
builds in C++). Unlike a greedy index, the position of each draw has a closed form, so any range of
positions is computed directly, with integers: deterministic, resumable at any consumed_samples, layout-independent.
Written here because no library in use exposes such an order (Megatron's helper is its C++ extension).

Weights are normalised and taken to parts per million (`PPM`), so the shares are exact integers.
"""

from __future__ import annotations

import os

import numpy as np

from .errors import DataError
from .layout import PREFERENCE_FORMAT, PROMPTS_FORMAT, dataset_format, dataset_info
from .sampler import epoch_order
from .sft import open_dataset

PPM = 10**6


def integer_weights(weights: list[float]) -> list[int]:
    """Each weight's share of their sum in parts per million, every one at least 1; the order's integers."""
    total = float(sum(weights))
    return [max(1, round(PPM * w / total)) for w in weights]


def _position(a: list[int], i: int, k: int) -> int:
    """The blend position of draw k of source i: how many draws of all sources come before it."""
    x_own = 2 * k + 1
    pos = k
    for j, aj in enumerate(a):
        if j == i:
            continue
        x = x_own * aj  # draw m of source j is earlier iff (2m+1) a_i < x, or == x and j < i
        if j < i:
            pos += (x - a[i]) // (2 * a[i]) + 1 if x >= a[i] else 0
        else:
            pos += -(-(x - a[i]) // (2 * a[i])) if x > a[i] else 0
    return pos


def _first_draw_at(a: list[int], i: int, position: int) -> int:
    """The smallest k whose position is >= `position` (positions grow with k, and position(k) >= k)."""
    lo, hi = 0, position
    while lo < hi:
        mid = (lo + hi) // 2
        if _position(a, i, mid) < position:
            lo = mid + 1
        else:
            hi = mid
    return lo


def blend_order(weights: list[float], start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(source index, draw index within that source) of blend positions [start, start + count)."""
    a = integer_weights(weights)
    source = np.full(count, -1, np.int64)
    draw = np.empty(count, np.int64)
    for i in range(len(a)):
        ks = range(_first_draw_at(a, i, start), _first_draw_at(a, i, start + count))
        for k in ks:  # about w_i * count draws
            p = _position(a, i, k) - start
            source[p], draw[p] = i, k
    assert (source >= 0).all(), "every position holds exactly one draw"
    return source, draw


def blend_errors(blend: dict[str, float]) -> list[str]:
    """One line per source that is not a prepared dataset, then (all being datasets) a blend of tokenizers or
    formats: a sample's token ids mean one tokenizer's tokens, and one training step one kind of sample."""
    infos, errors = {}, []
    for d in blend:
        if not os.path.isdir(d):
            errors.append(f"data.blend source {d!r} does not exist; prepare it with `deepseek-ds data prepare "
                          "--input ... --out DIR` or remove it from the blend")
            continue
        try:
            infos[d] = dataset_info(d)
        except DataError as e:
            errors.append(f"data.blend source {d!r}: {e}")
    if errors:
        return errors
    hashes = {d: info["tokenizer_hash"] for d, info in infos.items()}
    if len(set(hashes.values())) > 1:
        errors.append("data.blend sources were tokenized with different tokenizers ("
                      + ", ".join(f"{d}: {h[:12]}" for d, h in hashes.items()) + "); prepare them all with one "
                      "tokenizer (`data prepare --tokenizer DIR`)")
    formats = {d: dataset_format(info) for d, info in infos.items()}
    if len(set(formats.values())) > 1:
        errors.append("data.blend sources are of different formats (" + ", ".join(f"{d}: {f}" for d, f in
                      formats.items()) + "); blend raw text with raw text, chat with chat")
    if PREFERENCE_FORMAT in formats.values():
        errors.append("data.blend of preference datasets: pairs are not blended; set data.path to one dataset")
    if PROMPTS_FORMAT in formats.values():
        errors.append("data.blend of prompts datasets: prompts are not blended; set data.path to one dataset (prepare "
                      "it from all the prompt files at once)")
    return errors


def source_labels(dirs: list[str]) -> list[str]:
    """Each source's name in metrics (loss/<label>): its directory's name, or its path where names repeat."""
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    return [n if names.count(n) == 1 else os.path.normpath(d) for n, d in zip(names, dirs)]


class BlendedDataset:
    """Samples of several opened datasets (same kind, same tokenizer) at blend positions: index p is position p of
    the blend, unbounded (the sampler gives positions directly: `positional`). Source i's draw k is its sample
    epoch_order(N_i, (seed, i), k // N_i)[k % N_i]."""

    positional = True

    def __init__(self, names: list[str], datasets: list, weights: list[float], seed: int, shuffle: bool = True):
        self.names, self.datasets, self.weights = list(names), list(datasets), list(weights)
        self.labels = source_labels(self.names)
        self.seed, self.shuffle = seed, shuffle
        first = self.datasets[0]
        for flag in ("gives_position_ids", "pairs"):
            setattr(self, flag, getattr(first, flag, False))
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def _sample_index(self, i: int, k: int) -> int:
        n = len(self.datasets[i])
        key = (i, k // n)
        if key not in self._orders:
            self._orders = {s: o for s, o in self._orders.items() if s[0] != i or s[1] == key[1] - 1}
            self._orders[key] = epoch_order(n, (self.seed, i), key[1], self.shuffle)
        return int(self._orders[key][k % n])

    def locate(self, start: int, count: int) -> list[tuple[int, int]]:
        """(source index, sample index in that source) of positions [start, start + count)."""
        sources, draws = blend_order(self.weights, start, count)
        return [(int(i), self._sample_index(int(i), int(k))) for i, k in zip(sources, draws)]

    def sources_of(self, positions: list[int]) -> np.ndarray:
        """The source index of each of these (contiguous) positions."""
        if not positions:
            return np.zeros(0, np.int64)
        assert positions == list(range(positions[0], positions[0] + len(positions))), "a micro-batch is contiguous"
        return blend_order(self.weights, positions[0], len(positions))[0]

    def epochs(self, consumed: int) -> dict[str, float]:
        """How many epochs of each source (by label) the first `consumed` positions hold."""
        a = integer_weights(self.weights)
        return {label: _first_draw_at(a, i, consumed) / len(self.datasets[i]) for i, label in enumerate(self.labels)}

    def report(self) -> str:
        return "data.blend: " + ", ".join(f"{label} {w / sum(self.weights):.1%} of the order ({len(d):,} samples)"
                                          for label, w, d in zip(self.labels, self.weights, self.datasets))

    def __getitem__(self, position: int):
        (i, index), = self.locate(int(position), 1)
        return self.datasets[i][index]


def open_training_data(data, dataset_dir: str, seed: int, shuffle: bool, split: str = "train"):
    """A run's training (or validation) data: the dataset directory's split (data.path or the built-in corpus), or
    with data.blend the blend of its sources' `split`s in the run's order (train.seed, train.shuffle)."""
    if not data.blend:
        return open_dataset(dataset_dir, data, split)
    names = list(data.blend)
    return BlendedDataset(names, [open_dataset(d, data, split) for d in names], [data.blend[d] for d in names],
                          seed, shuffle)
