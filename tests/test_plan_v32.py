"""`plan` for DeepSeek-V3.2's trainable lightning indexer (indexer.stage warmup / sparse): the activation bytes against
what autograd holds at the end of a training forward (test_plan._saved_bytes; the query blocks' checkpoints save their
inputs through autograd's hooks, so they are seen too), and the trainable parameters (gradients, optimizer states)
against the ones train_indexers leaves requiring gradients."""

from __future__ import annotations

import pytest
import torch

from deepseek_ds.models.deepseek_v32.indexer import train_indexers
from deepseek_ds.models.deepseek_v32.indexer_loss import IndexerLoss
from deepseek_ds.models.pipeline import build_model, prepare_config, split_micro_batch
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.plan import activations
from deepseek_ds.plan.params import SpecParams, rank_params
from test_plan import _saved_bytes


def _trained_forward_bytes(stage: str, seq: int, batch: int = 2) -> tuple[int, object]:
    """What autograd holds after a tiny-v32 training forward with trainable indexers, wired as build_run wires them
    (train_indexers, IndexerLoss's hooks, the query mask split_micro_batch carries)."""
    mcfg = prepare_config(build_model_config("tiny-v32"))
    torch.manual_seed(0)
    model = build_model(mcfg, 1, 1).train()
    train_indexers(model, stage)
    indexer_loss = IndexerLoss(model, 1.0, mcfg.num_hidden_layers, torch.device("cpu"))
    ids = torch.randint(0, mcfg.vocab_size, (batch, seq))
    inputs, _ = split_micro_batch((ids, torch.randint(0, mcfg.vocab_size, (batch, seq))), query_mask=True)
    indexer_loss.set_global_tokens(torch.tensor(batch * seq), 1)
    return _saved_bytes(model, inputs, False), mcfg


def _predicted(mcfg, seq: int, stage: str, batch: int = 2) -> tuple[int, int]:
    return activations.stage_micro_batch_bytes(mcfg, [0, mcfg.num_hidden_layers + 3], 0, batch * seq, seq, 4, 1,
                                               False, 0, with_loss=False, zero=1, indexer=stage)


@pytest.mark.unit
@pytest.mark.parametrize("seq", [64, 128])
def test_v32_sparse_indexer_activation_bytes_within_2_percent_of_autograd(seq):
    """sparse (tiny-v32 keeps 16 keys of each query's 64 or 128): the indexer's per-layer bytes (rotated queries and
    keys, head weights, the main attention's queries and keys, the chosen keys) on top of the model's. Measured -1.30%
    at 64 tokens and -1.27% at 128 (the frozen model's own estimate runs 1.4% low); without the indexer's term the
    estimate is 12.9% and 12.3% low. Two lengths check that nothing kept grows with seq_len per query."""
    saved, mcfg = _trained_forward_bytes("sparse", seq)
    predicted, _ = _predicted(mcfg, seq, "sparse")
    assert abs(predicted - saved) <= 0.02 * saved, (seq, predicted, saved)
    frozen, _ = _predicted(mcfg, seq, "frozen")
    assert saved - frozen > 0.1 * saved  # the indexer's term is what makes the estimate fit


@pytest.mark.unit
def test_v32_warmup_activation_bytes_are_an_upper_bound():
    """warmup: the model is frozen, so autograd keeps of its layers only what their inputs' gradients need; plan
    counts them as trained (an upper bound, documented), plus the indexers' exact term: measured +48%."""
    saved, mcfg = _trained_forward_bytes("warmup", 96)
    predicted, _ = _predicted(mcfg, 96, "warmup")
    assert saved <= predicted <= 1.6 * saved, (predicted, saved)


@pytest.mark.unit
def test_v32_indexer_transient_is_a_few_query_blocks_not_the_whole_scores():
    """The once-per-rank transient with trainable indexers at the released shapes and 8K tokens: one query block's
    backward (3 fp32 score blocks, bounded by the indexer's chunk_elements) or, larger here, the forward's recomputed
    attention queries and keys (2.0 GB), far below the 16 GiB [B, S, H_I, T] tensor; the frozen stage has none.
    (bench indexer measures it: 3% above the estimate, docs/bench/indexer-memory.md.)"""
    mcfg = prepare_config(build_model_config("deepseek-v3.2"))
    seq, f = 8192, 2
    whole = seq * mcfg.index_n_heads * seq * 4
    _, frozen = activations.stage_micro_batch_bytes(mcfg, [0, 2], 0, seq, seq, f, 1, True, 0, False, 1)
    _, sparse = activations.stage_micro_batch_bytes(mcfg, [0, 2], 0, seq, seq, f, 1, True, 0, False, 1,
                                                    indexer="sparse")
    rows = max(1, 2**25 // (max(mcfg.index_n_heads, mcfg.num_attention_heads) * seq))  # TrainableIndexer's rule
    assert frozen == 0 and 3 * 4 * rows * mcfg.index_n_heads * seq <= sparse < whole / 4, (sparse, whole)


@pytest.mark.unit
@pytest.mark.parametrize("stage", ["frozen", "warmup", "sparse"])
def test_v32_trainable_parameters_follow_indexer_stage(stage):
    """plan's trainable parameters (which hold gradients and optimizer states) are what the engine is given: the ones
    requiring gradients once build_run has applied indexer.stage (frozen: all but the indexers; warmup: the indexers
    alone; sparse: everything)."""
    mcfg = prepare_config(build_model_config("tiny-v32"))
    model = build_model(mcfg, 1, 0)
    if stage != "frozen":
        train_indexers(model, stage)
    specs = SpecParams(mcfg)
    params = rank_params(specs, [0, len(specs.specs)], 0, 1, 1, indexer=stage)
    trainable = [(".indexer." in p.name, p.numel) for p in params if p.trainable]
    expected = [(".indexer." in n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted(expected)
    indexers = [numel for in_indexer, numel in trainable if in_indexer]
    assert bool(indexers) == (stage != "frozen")
    assert (len(indexers) == len(trainable)) == (stage == "warmup")
    assert sum(p.numel for p in params) == sum(p.numel() for p in model.parameters())
