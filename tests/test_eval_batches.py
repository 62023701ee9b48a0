"""Evaluation building blocks: the layout-independent split of the evaluation set over ranks, and the sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deepseek_ds.data import PackedDataset
from deepseek_ds.models.loss import IGNORE_INDEX
from deepseek_ds.training.evaluation import TokenSums, eval_sample_count, rank_batches

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dp,mb", [(1, 8), (2, 4), (3, 5), (4, 16)])
def test_ranks_cover_the_evaluation_set_exactly_once(data_dir, dp, mb):
    valid = PackedDataset(data_dir, 32, split="valid")
    n = eval_sample_count(len(valid), batches=2, global_batch_size=50)
    assert n == min(len(valid), 100)
    per_rank = [rank_batches(valid, n, mb, r, dp) for r in range(dp)]
    assert len({len(b) for b in per_rank}) == 1  # the same number of forwards everywhere (collectives)
    rows = [(x[i], y[i]) for batches in per_rank for x, y in batches for i in range(mb)]
    real = [(x, y) for x, y in rows if (y != IGNORE_INDEX).any()]
    assert all((x == 0).all() and (y == IGNORE_INDEX).all() for x, y in rows if (y == IGNORE_INDEX).all())
    expected = [torch.from_numpy(valid[i].astype(np.int64)) for i in range(n)]
    assert len(real) == n
    for (x, y), s in zip(real, expected):
        assert torch.equal(x, s[:-1]) and torch.equal(y, s[1:])


def test_evaluation_batches_of_a_dataset_with_position_ids_are_training_triples(data_dir):
    """Chat data and document_mask give (input_ids, labels, position_ids) rows: evaluation takes them as training
    does; a padding row is one document of ignored labels."""
    valid = PackedDataset(data_dir, 32, split="valid", document_mask=True)
    n = min(len(valid), 7)
    batches = rank_batches(valid, n, 4, 0, 1)
    rows = [tuple(t[i] for t in batch) for batch in batches for i in range(4)]
    for (x, y, pos), i in zip(rows, range(n)):
        expected = torch.from_numpy(valid[i].astype(np.int64))
        assert torch.equal(x, expected[0]) and torch.equal(y, expected[1]) and torch.equal(pos, expected[2])
    for _, y, pos in rows[n:]:
        assert (y == IGNORE_INDEX).all() and torch.equal(pos, torch.arange(32))


def test_token_sums_are_loss_tokens_and_hits():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[1, 2:] = IGNORE_INDEX
    sums = TokenSums()
    returned = sums(logits[:1], labels[:1]) + sums(logits[1:], labels[1:])
    ce, tokens, correct = sums.sums("cpu").tolist()
    valid = labels != IGNORE_INDEX
    assert tokens == 7
    assert ce == pytest.approx(float(F.cross_entropy(logits[valid], labels[valid], reduction="sum")), rel=1e-6)
    assert float(returned) == pytest.approx(ce, rel=1e-6)
    assert correct == int((logits.argmax(-1)[valid] == labels[valid]).sum())
    assert TokenSums().sums("cpu").tolist() == [0.0, 0.0, 0.0]  # a rank that computed no loss
