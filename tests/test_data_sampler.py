"""GlobalBatchSampler: one global order, sliced over DP ranks, resumable across layouts."""

import numpy as np
import pytest
import torch

from deepseek_ds.data import GlobalBatchSampler, micro_batches

pytestmark = pytest.mark.unit


def global_batches(num_samples, gbs, mbs, dp_size, seed, n_batches, shuffle=True, consumed=0):
    """The global batches seen by all ranks together, each rank's slice concatenated in rank order."""
    samplers = [GlobalBatchSampler(num_samples, gbs, mbs, r, dp_size, seed, shuffle, consumed) for r in range(dp_size)]
    iters = [iter(s) for s in samplers]
    out = []
    for _ in range(n_batches):
        out.append([i for it in iters for micro in next(it) for i in micro])
    return out, samplers


def test_rank_slices_form_the_global_batch():
    s = GlobalBatchSampler(100, 12, 2, 0, 1, seed=3)
    expected = [s.global_batch(k * 12).tolist() for k in range(5)]
    got, samplers = global_batches(100, 12, 2, 3, seed=3, n_batches=5)
    assert got == expected
    # Each rank: G/D/M micro-batches of M, the contiguous slice [r*G/D, (r+1)*G/D).
    micro = next(iter(GlobalBatchSampler(100, 12, 2, 1, 3, seed=3)))
    assert micro == [expected[0][4:6], expected[0][6:8]]
    assert all(s.consumed_samples == 60 for s in samplers)


def test_epoch_covers_every_sample_once_and_continues_seamlessly():
    n, g = 50, 8  # 50 is not a multiple of 8: batches straddle epochs
    batches, _ = global_batches(n, g, 2, 2, seed=0, n_batches=13)
    flat = [i for b in batches for i in b]  # 104 positions
    assert sorted(flat[:n]) == list(range(n))
    assert sorted(flat[n:2 * n]) == list(range(n))
    assert flat[:n] != flat[n:2 * n]  # a new permutation per epoch


def test_deterministic_by_seed():
    a, _ = global_batches(64, 8, 4, 2, seed=7, n_batches=4)
    b, _ = global_batches(64, 8, 4, 2, seed=7, n_batches=4)
    c, _ = global_batches(64, 8, 4, 2, seed=8, n_batches=4)
    assert a == b
    assert a != c


def test_no_shuffle_is_file_order():
    batches, _ = global_batches(10, 4, 1, 2, seed=5, n_batches=4, shuffle=False)
    assert [i for b in batches for i in b] == list(range(10)) + list(range(6))


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_with_other_dp_size_continues_the_same_sequence(shuffle):
    n, g = 37, 12
    reference, _ = global_batches(n, g, 1, 1, seed=11, n_batches=9, shuffle=shuffle)
    first, samplers = global_batches(n, g, 3, 2, seed=11, n_batches=4, shuffle=shuffle)
    consumed = samplers[0].consumed_samples
    assert consumed == 4 * g
    rest, _ = global_batches(n, g, 1, 4, seed=11, n_batches=5, shuffle=shuffle, consumed=consumed)
    assert first + rest == reference
    flat = [i for b in first + rest for i in b]
    assert sorted(flat[:n]) == list(range(n))  # across the layout change: nothing skipped or repeated


def test_invalid_layouts_are_rejected():
    with pytest.raises(ValueError, match=r"global_batch_size\(10\).*micro_batch_size\(2\).*dp_size\(3\)"):
        GlobalBatchSampler(100, 10, 2, 0, 3, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        GlobalBatchSampler(100, 8, 2, 2, 2, seed=0)


def test_micro_batches_are_shifted_long_tensors():
    data = [np.arange(i * 10, i * 10 + 6, dtype=np.int64) for i in range(20)]  # seq_len 5
    sampler = GlobalBatchSampler(20, 8, 2, 1, 2, seed=0, shuffle=False)
    batch = next(micro_batches(data, sampler))
    assert len(batch) == 2 and sampler.consumed_samples == 8
    x, y = batch[0]
    assert x.dtype == torch.long and x.shape == (2, 5) and y.shape == (2, 5)
    assert x[0].tolist() == list(range(40, 45)) and y[0].tolist() == list(range(41, 46))
    assert batch[1][0][:, 0].tolist() == [60, 70]
