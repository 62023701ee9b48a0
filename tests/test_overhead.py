"""`deepseek-ds bench overhead` in a smoke run: the table's rows hold real timings, and the bare loops really are the
same computation (their first loss is ours). No timed asserts: this host is shared."""

import csv
import math

import pytest

from helpers import cli


@pytest.mark.launch
def test_bench_overhead_smoke(data_dir, tmp_path, capsys):
    out = tmp_path / "overhead"
    assert cli(["bench", "overhead", "--config", "recipes/tiny-dense.yaml", "--steps", "2", "--warmup", "1",
                "--compile", "no", "--allow-busy", "--out", str(out), "--set", f"data.path={data_dir}"]) == 0
    printed = capsys.readouterr().out
    with open(out / "overhead.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["reference"] for r in rows] == ["bare transformers + AdamW", "bare DeepSpeed engine",
                                              "transformers.Trainer"]
    for r in rows:
        for key in ("ours_s", "reference_s", "ratio"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (key, r)
        assert float(r["ratio"]) == pytest.approx(float(r["reference_s"]) / float(r["ours_s"]))
    bare, engine, trainer = rows
    # The Trainer row is Trainer with its DeepSpeed integration on CPU too (the worker checks its engine's stage).
    assert trainer["variant"] == "trainer+deepspeed", trainer
    assert "a DeepSpeedEngine at ZeRO stage 1 over 2 data-parallel ranks" in (out / "overhead.md").read_text()
    # Same initial weights, same first global batch, same token-weighted loss: the same number.
    assert float(bare["ours_first_loss"]) == pytest.approx(float(bare["reference_first_loss"]), rel=1e-5)
    # The bare engine is a second run of the same config: the same engine and weights, so the same loss.
    assert float(engine["ours_first_loss"]) == pytest.approx(float(engine["reference_first_loss"]), rel=1e-6)
    # Trainer's loss drops each sample's last target (it shifts labels itself): close, not equal.
    assert float(trainer["ours_first_loss"]) == pytest.approx(float(trainer["reference_first_loss"]), rel=0.05)
    assert "reference / ours" in printed and (out / "overhead.md").read_text().count("|") > 10


@pytest.mark.unit
def test_trainer_engine_check_refuses_a_trainer_without_deepspeed():
    """The Trainer row's check: a wrapped model that is not a DeepSpeedEngine is an error, not a quiet DDP row."""
    from types import SimpleNamespace

    import torch

    from deepseek_ds.bench.overhead_worker import _trainer_engine

    with pytest.raises(RuntimeError, match="did not run DeepSpeed at the JSON's ZeRO stage 1: .* a Linear"):
        _trainer_engine(SimpleNamespace(model_wrapped=torch.nn.Linear(2, 2)), 1)
