"""GlobalBatchSampler: one global order, sliced over DP ranks, resumable across layouts; with PackedDataset, the same
sample ids and tokens as the references' own data order (tests/reference_data.py)."""

import numpy as np
import pytest
import torch

import reference_data
from deepseek_ds.data import GlobalBatchSampler, PackedDataset, dataset_info, micro_batches, prepare_dataset

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


# ----------------------------------------------------------------------------------------------- against the reference
# The references' own data order (tests/reference_data.py, written from the documented semantics): the toolkit's
# sampler and dataset must give every rank the same sample ids and the same tokens.

@pytest.fixture(scope="module")
def stream_dataset(tmp_path_factory) -> str:
    """A prepared text dataset of 8 train shards of 400-800 tokens: samples cross shard and document boundaries."""
    src = tmp_path_factory.mktemp("stream_docs")
    for k in range(12):
        (src / f"doc{k:02d}.txt").write_text("\n".join(f"def f{(k * 7 + i) % 50}(x): return x + {i}"
                                                       for i in range(10 + 5 * k)))
    out = prepare_dataset([str(src)], str(tmp_path_factory.mktemp("stream") / "ds"), vocab_size=300, shard_mb=0.001,
                          progress=False)
    assert len(dataset_info(out)["splits"]["train"]["shards"]) > 4
    return out


def toolkit_steps(dataset, gbs, mbs, dp_rank, dp_size, seed, shuffle, consumed, steps):
    """(sample ids, micro-batch tensors) per step of one rank, as the training loop reads them."""
    make = lambda: GlobalBatchSampler(len(dataset), gbs, mbs, dp_rank, dp_size, seed, shuffle, consumed)  # noqa: E731
    ids, tensors = iter(make()), micro_batches(dataset, make())
    return [(next(ids), next(tensors)) for _ in range(steps)]


def reference_steps(data, gbs, mbs, dp_rank, dp_size, seed, shuffle, consumed, steps):
    out = []
    for step in range(1, steps + 1):
        samples = reference_data.step_samples(step, len(data), gbs, seed, shuffle, consumed)
        micro = reference_data.rank_micro_batches(samples, dp_rank, dp_size, mbs)
        out.append((micro, [reference_data.stack(data, m) for m in micro]))
    return out


# (seq_len, global batch, micro batch, dp size, seed, consumed samples, shuffle, document_mask)
CASES = [
    (16, 8, 2, 2, 7, 0, True, False),       # 292 samples: several steps inside the first epoch
    (64, 12, 2, 3, 3, 5, True, False),      # 72 samples, resumed mid-batch, 3 ranks
    (256, 8, 1, 4, 11, 10, True, False),    # 18 samples: batches straddle epochs
    (1024, 12, 3, 2, 0, 0, True, False),    # 4 samples: one global batch holds three epochs
    (32, 6, 3, 1, 5, 140, False, False),    # file order, resumed past the end of the first epoch
    (48, 8, 2, 2, 9, 3, True, True),        # document_mask: position ids restart after each EOS
]


@pytest.mark.parametrize("seq_len,gbs,mbs,dp_size,seed,consumed,shuffle,document_mask", CASES)
def test_toolkit_order_equals_the_reference_order(stream_dataset, seq_len, gbs, mbs, dp_size, seed, consumed, shuffle,
                                                  document_mask):
    dataset = PackedDataset(stream_dataset, seq_len, document_mask=document_mask)
    data = reference_data.StreamSamples(stream_dataset, seq_len, document_mask=document_mask)
    assert len(dataset) == len(data)
    steps = 5
    for rank in range(dp_size):
        ours = toolkit_steps(dataset, gbs, mbs, rank, dp_size, seed, shuffle, consumed, steps)
        theirs = reference_steps(data, gbs, mbs, rank, dp_size, seed, shuffle, consumed, steps)
        for step, ((ids, batch), (ref_ids, ref_batch)) in enumerate(zip(ours, theirs), start=1):
            assert ids == ref_ids, (rank, step)
            assert len(batch) == len(ref_batch) == gbs // (mbs * dp_size)
            for micro, ref in zip(batch, ref_batch):
                assert len(micro) == len(ref) == (3 if document_mask else 2)
                assert all(torch.equal(a, b) for a, b in zip(micro, ref)), (rank, step)
    if document_mask:  # the case really has documents inside samples
        assert any((x[2][:, 1:] == 0).any() and (x[1] == reference_data.IGNORE_INDEX).any()
                   for _, b in theirs for x in b)


@pytest.mark.parametrize("num_samples", [1, 3, 7, 8, 50, 97])
def test_sampler_ids_equal_the_reference_for_any_dataset_size(num_samples):
    """Sample ids alone (no dataset): sizes below, at and above the global batch, several layouts and resumes."""
    for gbs, mbs, dp_size, seed, consumed, shuffle in [(8, 2, 2, 1, 0, True), (12, 1, 4, 2, 7, True),
                                                        (6, 3, 2, 3, 13, False), (16, 4, 1, 4, 99, True)]:
        for rank in range(dp_size):
            sampler = iter(GlobalBatchSampler(num_samples, gbs, mbs, rank, dp_size, seed, shuffle, consumed))
            for step in range(1, 7):
                samples = reference_data.step_samples(step, num_samples, gbs, seed, shuffle, consumed)
                assert next(sampler) == reference_data.rank_micro_batches(samples, rank, dp_size, mbs)
