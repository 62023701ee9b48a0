"""Limits on discarded updates, without a launch: fp16's loss scale at its minimum (DeepSpeed's own exception, from a
real DynamicLossScaler) and train.max_consecutive_skips, each driving the real training loop on a fake engine. The
consecutive-skips limit also runs for real in tests/test_observability.py (NaN losses injected through the launcher)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from deepseek_ds.config import run_config_from_dict
from deepseek_ds.data import GlobalBatchSampler
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.parallel.degrees import Degrees
from deepseek_ds.parallel.layout import RankLayout
from deepseek_ds.training import loop, nan_policy
from deepseek_ds.training.objectives import make_objective

pytestmark = pytest.mark.unit

STEPS, LR = 8, 2.5e-4


def deepspeed_min_scale_error() -> Exception:
    """What DeepSpeed raises when an fp16 step overflows with the loss scale already at fp16.min_loss_scale."""
    scaler = DynamicLossScaler(init_scale=1, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)
    with pytest.raises(Exception) as info:
        scaler.update_scale(True)
    return info.value


class FakeEngine:
    """What the loop reads from a DeepSpeed engine; `skipped_steps` moves as the scripted steps say."""
    device = torch.device("cpu")
    skipped_steps = 0

    def get_lr(self):
        return [LR]

    def get_global_grad_norm(self):
        return 1.0


def run_loop(monkeypatch, step_outcome, max_consecutive_skips: int, saved: list[int]) -> None:
    """Run loop._steps for STEPS steps, the step (_local_step) replaced by step_outcome(step, engine) -> loss (or raise);
    the steps the loop saves are appended to `saved`."""
    cfg = run_config_from_dict({
        "model": {"preset": "tiny-dense"}, "data": {"seq_len": 8},
        "train": {"steps": STEPS, "micro_batch_size": 1, "global_batch_size": 1, "nan_policy": "skip",
                  "max_consecutive_skips": max_consecutive_skips}})
    engine = FakeEngine()
    run = SimpleNamespace(cfg=cfg, engine=engine, model_config=build_model_config("tiny-dense"), world=1, rank=1,
                          loss_fn=SimpleNamespace(mtp_depth=0), balancer=None, indexer=None, clipping=None, pipeline=False, dp_size=1,
                          objective=make_objective(cfg.train.objective),
                          layout=RankLayout(Degrees(), world=1, rank=0, data_rank=0, data_size=1),
                          grad_accum=1, dataset=[np.zeros(9, np.int64)] * 4,
                          log=logging.getLogger("test_skipped_steps"), saver=None,
                          ds={"fp16": {"enabled": True, "initial_scale_power": 16, "min_loss_scale": 1}})
    steps = iter(range(1, STEPS + 1))
    monkeypatch.setattr(loop, "_local_step", lambda run, batch: torch.tensor(step_outcome(next(steps), engine),
                                                                        dtype=torch.float64))
    monkeypatch.setattr(loop, "save",
                        lambda run, step, consumed, background=False: saved.append(step) or f"ckpt/step{step}")
    sampler = GlobalBatchSampler(4, 1, 1, 0, 1, seed=0)
    stop = SimpleNamespace(requested=lambda asked: asked, flag=lambda save_failed: torch.zeros(1, dtype=torch.float64))
    loop._steps(run, sampler, None, stop, 0)


def test_deepspeeds_min_scale_exception_is_recognised_and_nothing_else():
    assert nan_policy.at_min_loss_scale(deepspeed_min_scale_error())
    assert not nan_policy.at_min_loss_scale(Exception("another failure"))
    assert not nan_policy.at_min_loss_scale(RuntimeError(str(deepspeed_min_scale_error())))


def test_min_loss_scale_saves_and_stops_with_the_fix(monkeypatch):
    def outcome(step, engine):
        if step == 3:
            raise deepspeed_min_scale_error()
        return 1.0

    saved = []
    with pytest.raises(nan_policy.NonFiniteLoss) as info:
        run_loop(monkeypatch, outcome, 50, saved)
    assert saved == [3]  # the step DeepSpeed refused: its update, like the overflowing ones before it, never applied
    message = str(info.value)
    assert message.startswith("step 3: the fp16 gradients overflow even at the smallest loss scale")
    for part in ("fp16.min_loss_scale: 1", "fp16.initial_scale_power", f"train.lr {LR:.3g}", "ckpt/step3"):
        assert part in message
    assert nan_policy.at_min_loss_scale(info.value.__cause__)


def test_other_exceptions_pass_through_unsaved(monkeypatch):
    def outcome(step, engine):
        if step == 2:
            raise Exception("a bug")
        return 1.0

    saved = []
    with pytest.raises(Exception, match="a bug") as info:
        run_loop(monkeypatch, outcome, 50, saved)
    assert type(info.value) is Exception and saved == []


def discards(skipped: set[int]):
    """Steps whose update DeepSpeed discards with a finite loss (fp16 overflow)."""
    def outcome(step, engine):
        engine.skipped_steps += step in skipped
        return 1.0
    return outcome


def test_consecutive_skips_stop_at_the_limit(monkeypatch):
    saved = []
    with pytest.raises(nan_policy.NonFiniteLoss) as info:
        run_loop(monkeypatch, discards({2, 3, 5, 6, 7, 8}), 3, saved)
    assert saved == [7]
    assert str(info.value).startswith("step 7: DeepSpeed discarded the last 3 updates in a row "
                                      "(train.max_consecutive_skips: 3)")
    assert "ckpt/step7" in str(info.value) and f"train.lr (it is {LR:.3g})" in str(info.value)


def test_no_limit_and_a_broken_run_of_skips_train_on(monkeypatch):
    saved = []
    run_loop(monkeypatch, discards(set(range(1, STEPS + 1))), 0, saved)
    run_loop(monkeypatch, discards({1, 2, 4, 5, 7, 8}), 3, saved)
    assert saved == []


def test_counter():
    skips = nan_policy.ConsecutiveSkips(2)
    assert [skips.after_step(s) for s in (True, False, True, True, True)] == [False, False, False, True, True]
    assert skips.count == 3
