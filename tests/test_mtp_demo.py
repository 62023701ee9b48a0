"""scripts/mtp_demo.sh, shortened (4 steps): the MTP recipe on 2 pipeline stages through the real commands, its
printed summary and its report against the run's own metrics."""

import subprocess

import pytest

from deepseek_ds.utils.net import free_port
from helpers import ROOT, launch_env, read_metrics


@pytest.mark.launch
def test_mtp_demo_reports_the_runs_main_and_mtp_losses(tmp_path):
    out, report = tmp_path / "mtp", tmp_path / "report.md"
    env = {**launch_env(), "MTP_DIR": str(out), "MTP_REPORT": str(report)}
    # Its own port: a demo running at the same time holds deepspeed's default one.
    proc = subprocess.run(["bash", "scripts/mtp_demo.sh", "--set", "train.steps=4", "--set", "eval.interval=2",
                           "--set", "checkpoint.interval=4", "--master_port", str(free_port())], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    metrics = read_metrics(str(out))
    first, last = metrics[0], metrics[-1]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # The recipe's weight: loss = main + 0.3 x MTP, and both parts fall.
    assert last["loss"] == pytest.approx(last["lm_loss"] + 0.3 * last["mtp_loss"], rel=1e-6)
    assert last["lm_loss"] < first["lm_loss"] and last["mtp_loss"] < first["mtp_loss"]
    line = (f"main loss {first['lm_loss']:.2f} -> {last['lm_loss']:.2f}, MTP loss {first['mtp_loss']:.2f} -> "
            f"{last['mtp_loss']:.2f} over 4 steps")
    text = report.read_text()
    assert line in proc.stdout and line in text
    assert f"validation loss {last['eval_loss']:.2f} (step 4)" in text
    assert (f"| 4 | {last['loss']:.3f} | {last['lm_loss']:.3f} | {last['mtp_loss']:.3f} | {last['eval_loss']:.3f} |"
            in text)
    assert "**git commit**" in text and "bash scripts/mtp_demo.sh --set train.steps=4" in text
