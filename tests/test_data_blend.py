"""data.blend: the order against an exact sort of every draw's time (fractions, independent of blend.py's closed
form), every prefix within one sample of each source's share, resumable at any position; `data dump --config`
prints the run's own order; a 2-rank run on a blend trains on exactly the dumped samples (its first loss is
transformers' on them) and evaluates each source; bad blends are one line each before launch."""

from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stdout
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deepseek_ds.config import load_ds_config, load_run_config
from deepseek_ds.data import BlendedDataset, PackedDataset, prepare_dataset
from deepseek_ds.data.blend import PPM, blend_order, integer_weights
from deepseek_ds.data.layout import TOKENIZER_DIR
from helpers import cli, refused, train
from reference import reference_model

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
SETS = ["train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64", "checkpoint.interval=0",
        "train.steps=2", "eval.interval=2", "eval.batches=1"]


def _exact_order(weights: list[float], count: int) -> list[tuple[int, int]]:
    """(source, draw) of the first `count` positions: all draws sorted by time (k + 1/2) / w_i, ties to the lower
    source, with the weights as integers exactly as the blend takes them."""
    a = integer_weights(weights)
    draws = [(Fraction(2 * k + 1, 2 * ai), i, k) for i, ai in enumerate(a) for k in range(count + 1)]
    return [(i, k) for _, i, k in sorted(draws)[:count]]


@pytest.mark.unit
@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.2, 0.3, 0.5], [1, 1, 1]])
def test_blend_order_is_the_exact_sort_and_every_prefix_keeps_the_shares(weights):
    n = 4000
    sources, draws = blend_order(weights, 0, n)
    assert list(zip(sources.tolist(), draws.tolist())) == _exact_order(weights, n)
    shares = np.array(integer_weights(weights)) / PPM
    prefix = np.arange(1, n + 1)
    for i, share in enumerate(shares):
        assert np.abs(np.cumsum(sources == i) - share * prefix).max() <= 1.0
    for start in (1, 999, 3333):  # any position, computed directly: what a resume at consumed_samples asks for
        tail = blend_order(weights, start, n - start)
        assert np.array_equal(tail[0], sources[start:]) and np.array_equal(tail[1], draws[start:])


@pytest.mark.unit
def test_a_small_source_wraps_in_reshuffled_epochs(data_dir):
    big, small = PackedDataset(data_dir, 16), PackedDataset(data_dir, 16, split="valid")
    blend = BlendedDataset(["big", "small"], [big, small], [0.5, 0.5], seed=3)
    located = blend.locate(0, 4 * len(small))
    epochs = [[index for i, index in located if i == 1][e * len(small):(e + 1) * len(small)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(len(small))) and epochs[0] != epochs[1]
    assert blend.epochs(4 * len(small))["small"] == pytest.approx(2.0)
    assert np.array_equal(blend[5], [big, small][located[5][0]][located[5][1]])
    assert BlendedDataset(["big", "small"], [big, small], [0.5, 0.5], seed=3).locate(0, 50) == located[:50]
    assert BlendedDataset(["big", "small"], [big, small], [0.5, 0.5], seed=4).locate(0, 50) != located[:50]


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory, data_dir) -> str:
    """A second raw-text dataset (the project's Markdown) with data_dir's tokenizer."""
    return prepare_dataset([DOCS], str(tmp_path_factory.mktemp("blend") / "docs"),
                           tokenizer_dir=os.path.join(data_dir, TOKENIZER_DIR), valid_fraction=0.2,
                           extensions=(".md",), progress=False)


def _blend_set(data_dir: str, docs_dir: str) -> str:
    return f"data.blend={{{data_dir}: 0.3, {docs_dir}: 0.7}}"


def _dump(sets: list[str], start: int, count: int) -> list[dict]:
    out = io.StringIO()
    args = ["data", "dump", "--config", "recipes/tiny-v3.yaml", "--start", str(start), "--count", str(count)]
    for s in sets:
        args += ["--set", s]
    with redirect_stdout(out):
        assert cli(args) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.launch
def test_a_two_rank_run_trains_on_the_dumped_blend_and_evaluates_each_source(data_dir, docs_dir, tmp_path):
    sets = SETS + [_blend_set(data_dir, docs_dir)]
    dumped = _dump(sets, 0, 40)
    assert _dump(sets, 0, 40) == dumped and _dump(sets, 25, 15) == dumped[25:]
    assert {d["source"] for d in dumped} == {data_dir, docs_dir}
    assert abs(sum(d["source"] == docs_dir for d in dumped) - 0.7 * 40) <= 1
    records = train(2, str(tmp_path / "run"), sets)
    model, _ = reference_model(load_run_config("recipes/tiny-v3.yaml", sets + [f"data.path={data_dir}",
                                                                               "data.blend=null"]))
    ids = torch.tensor([d["input_ids"] for d in dumped[:8]])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids[:, :-1]).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()
    assert records[0]["loss"] == pytest.approx(want, rel=1e-5)
    for r in records:  # each source's token-weighted loss: their mean is the loss (tiny-v3 has no MTP)
        tokens = {n: r[f"tokens/{n}"] for n in (os.path.basename(data_dir), "docs")}
        assert sum(tokens.values()) == 8 * 64
        assert sum(r[f"loss/{n}"] * t for n, t in tokens.items()) / sum(tokens.values()) == pytest.approx(
            r["loss"], abs=1e-6)
    first = {n: sum(d["source"] == s for d in dumped[:8]) * 64 for n, s in ((os.path.basename(data_dir), data_dir),
                                                                           ("docs", docs_dir))}
    assert {n: records[0][f"tokens/{n}"] for n in first} == first
    last = records[-1]
    names = {os.path.basename(data_dir): 0.3, "docs": 0.7}
    for name, source in zip(names, (data_dir, docs_dir)):  # 2 steps x 8 samples drawn
        drawn = sum(d["source"] == source for d in dumped[:16])
        assert last[f"epochs/{name}"] == pytest.approx(drawn / len(PackedDataset(source, 64)))
    assert set(names) <= {k.removeprefix("eval_loss/") for k in last if k.startswith("eval_loss/")}
    assert last["eval_loss"] == pytest.approx(sum(w * last[f"eval_loss/{n}"] for n, w in names.items()), rel=1e-9)


@pytest.mark.unit
def test_bad_blends_are_one_line_each_before_launch(data_dir, docs_dir, tmp_path, deepseek_tokenizer_dir):
    ds = load_ds_config("ds_configs/zero1.json")
    other = prepare_dataset([DOCS], str(tmp_path / "other"),
                            tokenizer_dir=deepseek_tokenizer_dir, valid_fraction=0.2, extensions=(".md",),
                            progress=False)  # DeepSeek's tokenizer, not data_dir's
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.blend={{{data_dir}: 0.5, {other}: 0.5}}",
                                                          "model.overrides.vocab_size=129280"])
    assert refused(cfg, ds, world=2, match="data.blend sources were tokenized with different tokenizers")
    missing = str(tmp_path / "absent")
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.blend={{{data_dir}: 0.5, {missing}: 0.5}}"])
    message = refused(cfg, ds, world=2, match=f"data.blend source '{missing}' does not exist")
    assert message.count("\n  - ") == 1
    with pytest.raises(Exception, match="data.blend weight of .* is 0: weights must be numbers > 0"):
        load_run_config("recipes/tiny-v3.yaml", [f"data.blend={{{data_dir}: 0, {docs_dir}: 1}}"])
    with pytest.raises(Exception, match="data.path and data.blend are both set"):
        load_run_config("recipes/tiny-v3.yaml", [f"data.path={data_dir}", _blend_set(data_dir, docs_dir)])
