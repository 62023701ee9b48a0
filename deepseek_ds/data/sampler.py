"""One global sample order, cut into global batches, sliced over data-parallel ranks.

Global position p holds sample order(epoch)[p % N] with epoch = p // N, where order(epoch) is a
permutation of all N samples seeded by (seed, epoch) (identity without shuffling). Global batch k is
positions [k*G, (k+1)*G) counted from consumed_samples; DP rank r takes the contiguous slice
[r*G/D, (r+1)*G/D) and splits it in order into micro-batches of M. The layout (D, M) therefore only
decides who computes which sample, never which samples form a global batch, so a run can resume with
another data-parallel size and continue the same global sequence.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def epoch_order(num_samples: int, seed: int | tuple[int, ...], epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    # Seeded by the pair (seed, epoch): unlike seed + epoch, (0, 1) and (1, 0) give different orders. A tuple seed
    # (a blend's (seed, source)) extends the key.
    key = list(seed) if isinstance(seed, tuple) else [seed]
    return np.random.default_rng([*key, epoch]).permutation(num_samples)


class GlobalBatchSampler:
    """Yields, per global batch, this rank's micro-batches (lists of sample indices). Infinite: epochs
    follow each other seamlessly; stop after the steps you need.

    `consumed_samples` (global count) already includes a batch when it is yielded, so a checkpoint
    saved after that batch's optimizer step resumes exactly at the next batch.
    """

    def __init__(self, num_samples: int | None, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, shuffle: bool = True, consumed_samples: int = 0):
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if min(global_batch_size, micro_batch_size, dp_size) < 1 \
                or global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(f"global_batch_size({global_batch_size}) must be a positive multiple of "
                             f"micro_batch_size({micro_batch_size}) * dp_size({dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank({dp_rank}) must be in [0, dp_size({dp_size}))")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.consumed_samples = consumed_samples
        self._orders: dict[int, np.ndarray] = {}  # at most the two epochs a batch can straddle
        self.last: list[list[int]] = []  # the micro-batches of the last global batch yielded

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        return self._orders[epoch]

    def positions(self, start: int, count: int) -> np.ndarray:
        """Sample indices at global positions [start, start + count); num_samples None (a blend, which orders its
        own samples): the positions themselves."""
        pos = np.arange(start, start + count, dtype=np.int64)
        if self.num_samples is None:
            return pos
        epochs = pos // self.num_samples
        out = np.empty(count, np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._order(int(e))[pos[mask] % self.num_samples]
        return out

    def global_batch(self, start: int) -> np.ndarray:
        return self.positions(start, self.global_batch_size)

    def __iter__(self) -> Iterator[list[list[int]]]:
        per_rank = self.global_batch_size // self.dp_size
        while True:
            mine = self.global_batch(self.consumed_samples)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
            self.consumed_samples += self.global_batch_size
            # kept for the per-source metrics of a blend (the rows' sources of the batch being trained)
            self.last = [mine[j:j + self.micro_batch_size].tolist() for j in range(0, per_rank, self.micro_batch_size)]
            yield self.last


def sample_count(dataset) -> int | None:
    """What GlobalBatchSampler orders: the dataset's samples, or None for a blend (blend.BlendedDataset), indexed by
    global position."""
    return None if getattr(dataset, "positional", False) else len(dataset)


def micro_batches(dataset, sampler: GlobalBatchSampler) -> Iterator[list[tuple]]:
    """Per global batch, this rank's micro-batches as (input_ids, labels) LongTensor pairs of shape
    [micro_batch_size, seq_len]: labels are the inputs shifted by one token. A dataset that `gives_position_ids`
    (chat data, raw text with document_mask) gives (input_ids, labels, position_ids) triples instead, its labels
    already shifted and -100 where there is no loss."""
    for micro in sampler:
        yield [micro_batch(dataset, indices) for indices in micro]


def micro_batch(dataset, indices) -> tuple:
    """Samples `indices` of `dataset` as one micro-batch: (input_ids, labels) or, for a dataset that
    `gives_position_ids`, (input_ids, labels, position_ids); LongTensors [len(indices), seq_len]."""
    # torch here, not at the top: every `data prepare` worker imports this package and never needs it (~8x the
    # package's import time).
    import torch

    x = torch.from_numpy(np.stack([dataset[i] for i in indices]).astype(np.int64))
    if getattr(dataset, "pairs", False):  # [B, 2, 3, seq_len] -> [2B, 3, seq_len]: the B chosen rows, then rejected
        x = x.transpose(0, 1).reshape(-1, *x.shape[2:])
    if getattr(dataset, "gives_position_ids", False):
        return x[:, 0].contiguous(), x[:, 1].contiguous(), x[:, 2].contiguous()
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()
