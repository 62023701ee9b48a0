"""Observability without launches: config refusals (NaN policy, monitors, MFU peak), the peak table, monitor events,
and the router hooks' counting under activation checkpointing."""

from __future__ import annotations

import importlib.util
import json
import os
import resource

import pytest
import torch

from deepseek_ds.config import ConfigError, load_ds_config, resolve_ds_config, run_config_from_dict, validate
from deepseek_ds.training import metrics, monitors, nan_policy
from deepseek_ds.utils.errors import UserError

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ds(name: str, **extra) -> dict:
    return {**load_ds_config(os.path.join(ROOT, "ds_configs", name)), **extra}


def refused(cfg: dict, d: dict, match: str) -> str:
    """validate() must refuse with a message matching `match`; returns that message."""
    with pytest.raises(ConfigError, match=match) as e:
        validate(run_config_from_dict(cfg), d, world_size=2, cuda_available=False)
    return str(e.value)


def test_nan_policy_refusals():
    assert refused({"train": {"nan_policy": "ignore"}}, ds("zero1.json"), "train.nan_policy = 'ignore'")
    # ZeRO-0 fp32 applies non-finite updates: "skip" cannot be honoured there, "stop" can (without saving).
    assert refused({"train": {"nan_policy": "skip"}}, ds("zero0.json"), "ZeRO stage 0 in fp32")
    validate(run_config_from_dict({"train": {"nan_policy": "stop"}}), ds("zero0.json"), 2, cuda_available=False)
    validate(run_config_from_dict({"train": {"nan_policy": "skip"}}), ds("zero1.json"), 2, cuda_available=False)
    assert refused({"train": {"nan_policy": "skip"}}, ds("zero1_bf16.json", bf16={"enabled": True, "check_grad_overflow": False}),
            "ZeRO stage 1 in bf16")


@pytest.mark.parametrize("name,skips", [("zero0.json", False), ("zero1.json", True), ("zero2.json", True),
                                        ("zero3.json", True), ("zero1_bf16.json", True), ("zero1_fp16.json", True),
                                        ("zero1_pp.json", True)])
def test_which_deepspeed_configs_discard_nonfinite_steps(name, skips):
    assert nan_policy.skips_nonfinite_steps(ds(name)) is skips


def test_missing_monitor_package_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert refused({}, ds("zero1.json", wandb={"enabled": True}), r"'wandb' package is not installed.*pip install wandb")
    # csv_monitor needs no package; a disabled wandb section is not checked.
    validate(run_config_from_dict({}), ds("zero1.json", csv_monitor={"enabled": True}, wandb={"enabled": False}), 2,
             cuda_available=False)


def test_train_entry_refuses_a_missing_monitor_before_any_process_group(monkeypatch, tmp_path, capsys):
    from deepseek_ds.training.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    (tmp_path / "ds.json").write_text(json.dumps(ds("zero1.json", tensorboard={"enabled": True})))
    assert main(["--config", "recipes/tiny-v3.yaml", "--deepspeed_config", str(tmp_path / "ds.json"),
                 "--set", f"train.output_dir={tmp_path}"]) == 2
    assert "'tensorboard' package is not installed" in capsys.readouterr().err


def test_monitor_output_defaults_to_the_run_directory():
    cfg = run_config_from_dict({"train": {"output_dir": "runs/x"}})
    d = resolve_ds_config(ds("zero1.json", tensorboard={"enabled": True}, csv_monitor={"enabled": True, "output_path": "/o"}),
                          cfg, world_size=2)
    assert d["tensorboard"]["output_path"] == os.path.join("runs/x", "monitors")
    assert d["csv_monitor"]["output_path"] == "/o"


def test_peak_tflops_refusal_and_table(monkeypatch):
    assert refused({"train": {"peak_tflops": 0}}, ds("zero1.json"), "train.peak_tflops")
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert metrics.peak_tflops(cpu, None) is None
    assert metrics.peak_tflops(cpu, 100.0) == 100.0
    names = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.4, "NVIDIA GH200 480GB": 989.4,
             "NVIDIA H200": 989.4, "NVIDIA H20": 148.0, "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A10": 125.0,
             "NVIDIA L40S": 362.1, "NVIDIA GeForce GTX 1080": None}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert metrics.peak_tflops(gpu, None) == peak, name


def test_monitor_events_are_the_record_on_the_samples_axis():
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "mfu": None, "skipped": True,
              "consumed_samples": 48, "moe/layer1/load_max": 7.0}
    assert monitors.events(record, 48) == [("Train/Samples/loss", 2.5, 48), ("Train/Samples/skipped", 1.0, 48),
                                           ("Train/Samples/moe/layer1/load_max", 7.0, 48)]


def test_router_hooks_count_training_forwards_once():
    from deepseek_ds.models.pipeline import build_model, prepare_config
    from deepseek_ds.models.presets import build_model_config
    from deepseek_ds.training.router_stats import RouterStats

    mcfg = prepare_config(build_model_config("tiny-v3"))
    model = build_model(mcfg, 1, seed=1, activation_checkpoint_interval=1)
    stats = RouterStats(model, mcfg, torch.device("cpu"), reports_bias=True)
    x = torch.randint(0, mcfg.vocab_size, (2, 16))
    with torch.no_grad():
        model.eval()(x)  # evaluation traffic is not counted
    model.train()(x).float().sum().backward()  # the recomputation in backward is not counted either
    out = stats.metrics(stats.local_load().tolist(), stats.local_bias().tolist())  # one rank: nothing to reduce
    assert stats.layers == [1, 2, 3]
    for layer in stats.layers:
        assert out[f"moe/layer{layer}/load_mean"] == 2 * 16 * mcfg.num_experts_per_tok / mcfg.n_routed_experts
        assert out[f"moe/layer{layer}/bias_max"] == 0.0
    # local_load() resets the counts
    assert stats.metrics(stats.local_load().tolist(), stats.local_bias().tolist())["moe/layer1/load_max"] == 0.0


def test_a_metrics_line_torn_by_a_kill_is_dropped_at_resume_and_other_damage_is_an_error(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    records = [{"step": s, "loss": 10.0 - s} for s in (1, 2, 3)]
    whole = "".join(json.dumps(r) + "\n" for r in records)
    with open(path, "w") as f:
        f.write(whole + json.dumps({"step": 4, "loss": 6.0})[:9])  # killed halfway through step 4's line
    writer = metrics.MetricsWriter(path, resume_step=3)
    writer.close()
    assert writer.records == records
    with open(path) as f:
        assert f.read() == whole  # the torn tail is gone from the file too
    with open(path, "w") as f:
        f.write(json.dumps(records[0])[:9] + "\n" + whole)  # a torn line before others: not a kill's
    with pytest.raises(UserError, match=r"metrics.jsonl line 1 is not JSON"):
        metrics.MetricsWriter(path, resume_step=3)


def test_loss_plot_draws_task_scores_on_a_second_axis(tmp_path, monkeypatch):
    import matplotlib.figure

    records = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 11)]
    for r in records[4::5]:
        r.update(eval_loss=r["loss"] + 0.1, task_exact_match=r["step"] / 20, task_bleu=r["step"] * 3.0)
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path: saved.append(fig))
    metrics.plot_loss(records, str(tmp_path / "loss.png"), "t")
    loss_axis, score_axis = saved[0].axes
    assert [line.get_label() for line in loss_axis.get_legend().get_lines()] == [
        "train loss", "validation loss", "task exact match", "task BLEU / 100"]
    em, bleu = score_axis.get_lines()
    assert list(em.get_xdata()) == [5, 10] and list(em.get_ydata()) == [0.25, 0.5]
    assert list(bleu.get_ydata()) == [0.15, 0.3]
    metrics.plot_loss([{"step": 1, "loss": 1.0}], str(tmp_path / "plain.png"), "t")
    assert len(saved[1].axes) == 1  # no eval.task: one axis


def _rss() -> int:
    with open("/proc/self/statm") as f:  # resident pages: psutil's source too, read independently
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux: VmHWM and its reset")
def test_cpu_memory_is_the_peak_since_the_reset_and_the_fallback_says_so(monkeypatch):
    """memory_gb on CPU: the process's peak resident set since reset_peak_memory, not its RSS now. 256 MiB written
    and freed between a reset and the read shows in the peak (and not in the RSS after it); the next reset drops the
    peak back to the RSS. Without /proc the fallback is getrusage's lifetime peak and StepMeter says it cannot
    reset."""
    cpu, mib = torch.device("cpu"), 2**20
    assert metrics.reset_peak_memory(cpu)
    before = _rss()
    spike = torch.ones(64 * mib)  # 256 MiB, every page written
    during = _rss()
    del spike
    after = _rss()
    peak = metrics.peak_memory_bytes(cpu)
    assert during - before >= 250 * mib and during - after >= 250 * mib  # freed pages leave the resident set
    # The kernel's counters batch a thread's page counts (up to a few hundred KiB behind): 4 MiB either way.
    assert during - 4 * mib <= peak <= during + 16 * mib
    assert metrics.memory_gb(cpu) * 2**30 >= during - 4 * mib
    meter = metrics.StepMeter(1.0, 1, 1, 1, cpu, None)
    assert meter.resets
    meter.start()
    assert metrics.memory_gb(cpu) * 2**30 <= _rss() + 16 * mib < peak - 200 * mib
    # The step line names the unit the field holds (GiB) and that it is a peak.
    assert "peak mem 1.50 GiB" in metrics.console_line({"memory_gb": 1.5})

    monkeypatch.setattr(metrics, "PROC_STATUS", "/nonexistent/status")
    monkeypatch.setattr(metrics, "PROC_CLEAR_REFS", "/nonexistent/clear_refs")
    assert not metrics.reset_peak_memory(cpu) and not metrics.StepMeter(1.0, 1, 1, 1, cpu, None).resets
    assert metrics.peak_memory_bytes(cpu) == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
