"""Packed sequences never leak attention (issue 15, the model and training side): with position ids that restart at
0 at each sample, every sample's logits and losses are those it has alone in transformers' model, on every stage
and under ZeRO-1, ZeRO-3 and 2 pipeline stages; without restarts nothing changes."""

import json

import pytest
import torch
import torch.nn.functional as F

from deepseek_ds.config import load_run_config
from deepseek_ds.models.hf_io import to_hf_model
from deepseek_ds.models.layers import MTPLayerPipe, document_attention
from deepseek_ds.models.loss import TokenWeightedLoss, valid_token_counts
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from helpers import IGNORE_INDEX, train_layouts
from reference import mtp_logits, mtp_reference, pack, packed_reference_losses, random_samples

SEQ_LEN = 32


def models(preset: str, **overrides):
    """(our SequentialLM, transformers' CausalLM sharing its weights, its config), seeded init."""
    mcfg = prepare_config(build_model_config(preset, None, overrides))
    ours = build_model(mcfg, 1, seed=7)
    return ours, to_hf_model(local_layers(ours), mcfg), mcfg


def packed_rows(vocab_size: int, seed: int = 0, min_len: int = 2):
    """Two rows of SEQ_LEN: samples (with -100 prompt prefixes) packed first fit, the rest of each row padding."""
    gen = torch.Generator().manual_seed(seed)
    ids, labels, positions, samples = pack(random_samples(8, vocab_size, SEQ_LEN // 2, gen, min_len), 2, SEQ_LEN)
    assert (positions[:, 1:] == 0).sum() >= 3 and (labels == IGNORE_INDEX).any()  # several documents per row
    return ids, labels, positions, samples


def segments(positions: torch.Tensor):
    """(row, start, end) of every document, padding runs included."""
    for r, row in enumerate(positions.tolist()):
        starts = [t for t, p in enumerate(row) if p == 0] + [len(row)]
        yield from ((r, a, b) for a, b in zip(starts, starts[1:]))


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2", "tiny-dense"])
def test_packed_logits_equal_each_sample_alone(preset):
    ours, hf, mcfg = models(preset)
    ours.eval()
    ids, _, positions, _ = packed_rows(mcfg.vocab_size)
    with torch.no_grad():
        packed = ours((ids, positions))
        for r, a, b in segments(positions):  # every sample and every padding run, each alone in transformers
            alone = hf(input_ids=ids[r:r + 1, a:b]).logits[0]
            assert torch.allclose(packed[r, a:b], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
        # The comparison can fail: one causal stream over the same rows (attention crossing samples) differs.
        stream = ours(ids)
        r, a, b = next(s for s in segments(positions) if s[1] > 0)
        assert (stream[r, a:b] - packed[r, a:b]).abs().max() > 1e-3
        # No restarts: bitwise the mask-free path of input_ids alone (and transformers' own).
        arange = torch.arange(SEQ_LEN).expand_as(ids)
        assert torch.equal(ours((ids, arange)), stream)
        assert torch.equal(stream, hf(input_ids=ids).logits)


@pytest.mark.unit
def test_mtp_targets_stay_inside_each_sample():
    """DeepSeek-V3 with 2 MTP depths: each depth's token-weighted loss over packed rows equals that over the samples
    run alone through transformers' MtpModel (a depth-k target in the next sample is no target)."""
    ours, hf, mcfg = models("tiny-v3", num_nextn_predict_layers=2)
    ours.train()
    mtp = mtp_reference(hf.train(), [m for m in local_layers(ours) if isinstance(m, MTPLayerPipe)])
    ids, labels, positions, samples = packed_rows(mcfg.vocab_size, seed=1, min_len=3)  # MtpModel needs T > depth
    loss_fn = TokenWeightedLoss(mtp_depth=2, mtp_weight=0.3)
    counts = valid_token_counts([(ids, labels, positions)], depth=2).tolist()
    loss_fn.set_global_tokens(counts, dp_size=1, grad_accum=1)
    with torch.no_grad():
        loss_fn(ours((ids, positions)), (labels, positions))
        parts = loss_fn.take_parts(torch.device("cpu")).tolist()
        sums, alone_counts = [0.0] * 3, [0] * 3
        for x, y in samples:
            for k, logits in enumerate(mtp_logits(hf, mtp, x.unsqueeze(0))):
                sums[k] += F.cross_entropy(logits[0].float(), y[k:], ignore_index=IGNORE_INDEX, reduction="sum").item()
                alone_counts[k] += int((y[k:] != IGNORE_INDEX).sum())
    assert counts == alone_counts and counts[0] > counts[1] > counts[2] > 0
    assert parts == pytest.approx([s / c for s, c in zip(sums, counts)], rel=1e-5)


@pytest.mark.unit
def test_flash_attention_gets_varlen_boundaries():
    """flash_attention_2 (GPU only, not run here) takes the documents as varlen segments of the flattened batch;
    rows without restarts keep its mask-free path."""
    mcfg = prepare_config(build_model_config("tiny-dense", None, {}), attn_implementation="flash_attention_2")
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    kwargs = document_attention(mcfg, torch.zeros(2, 6, 8), positions)
    assert kwargs["attention_mask"] is None
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12] and kwargs["max_length_q"] == 4
    assert document_attention(mcfg, torch.zeros(2, 6, 8), torch.arange(6).expand(2, 6)) == {"attention_mask": None}


# ----------------------------------------------------------------------------------------------- launches
# MoE balancing off: its per-sequence terms and expert loads are over packed rows (padding included), not samples.
SETS = ["train.steps=2", "train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64",
        "train.warmup_steps=0", "checkpoint.interval=0", "eval.interval=0", "moe.bias_update_speed=0",
        "moe.seq_aux_alpha=0"]


@pytest.fixture(scope="module")
def reference(data_dir):
    return packed_reference_losses(load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={data_dir}"]))


LAYOUTS = [("zero1", "ds_configs/zero1.json", []), ("zero3", "ds_configs/zero3.json", []),
           ("pp2", "ds_configs/zero1_pp.json", ["parallel.pipeline_stages=2"]),
           # each packed row split over 2 ranks: documents cross the shard boundary
           ("sp2", "ds_configs/zero1.json", ["parallel.sequence_parallel=2"])]


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory, data_dir) -> dict:
    """Every layout's losses, all trained in one launch of packing_worker.py (one start-up instead of three)."""
    dirs = train_layouts(2, tmp_path_factory.mktemp("packed"), LAYOUTS, SETS + [f"data.path={data_dir}"],
                         worker="tests/packing_worker.py")
    return {name: json.loads((out / "losses.json").read_text()) for name, out in dirs.items()}


@pytest.mark.launch
@pytest.mark.parametrize("name,extra", [(n, e) for n, _, e in LAYOUTS], ids=[layout[0] for layout in LAYOUTS])
def test_packed_training_equals_samples_alone(name, extra, packed_runs, reference):
    got = packed_runs[name]
    assert got["dp_size"] == (1 if extra else 2)
    # Step 1: forward and loss; step 2: gradients, clipping and AdamW on the packed rows.
    assert got["losses"] == pytest.approx(reference, rel=1e-5), f"{name}: {got['losses']} vs {reference}"
    assert reference[0] != reference[1]
