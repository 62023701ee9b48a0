"""train.py runs unchanged under `torchrun` and `accelerate launch` (env:// rendezvous: RANK, WORLD_SIZE,
MASTER_ADDR/PORT, LOCAL_RANK, LOCAL_WORLD_SIZE) and trains exactly as under `deepspeed`: the same settings as
conftest's `zero1` run (2 ranks, ZeRO-1, 4 steps, saves at 2 and 4), whose per-step losses are the reference."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from deepseek_ds.utils.net import free_port
from helpers import BIN, ROOT, checkpoint_sets, launch_env, losses, read_metrics

LAUNCHERS = {
    "torchrun": lambda port: ["torchrun", "--nproc_per_node", "2", "--master_port", str(port)],
    # --multi_gpu is accelerate's torchrun-based launcher; it starts CPU ranks too when there is no GPU.
    "accelerate": lambda port: ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)],
}


def launch(launcher: str, out, data_dir: str) -> list[dict]:
    cmd = LAUNCHERS[launcher](free_port())
    cmd[0] = os.path.join(BIN, cmd[0])
    cmd += ["train.py", "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}"]
    for s in checkpoint_sets(data_dir, 4, 2):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return read_metrics(str(out))


@pytest.mark.launch
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_same_losses_as_deepspeed(launcher, tmp_path, data_dir, zero1):
    records = launch(launcher, tmp_path / "out", data_dir)
    got = losses(records)
    assert sorted(got) == [1, 2, 3, 4]
    reference = {step: zero1["losses"][step] for step in got if step in zero1["losses"]}
    assert len(reference) >= 3, f"the zero1 reference run logged only steps {sorted(zero1['losses'])}"
    assert got[1] > 7.0  # a real loss (about ln 2048 at the start), not a constant both runs could share
    for step, expected in reference.items():
        assert got[step] == pytest.approx(expected, rel=1e-6, abs=0), f"step {step} under {launcher}"
    # Two ranks really trained: each wrote its log and its ZeRO-1 optimizer shard, and the run recorded world 2.
    assert sorted(os.listdir(tmp_path / "out" / "logs")) == ["rank0.log", "rank1.log"]
    step4 = tmp_path / "out" / "checkpoints" / "step00000004"
    assert sorted(p.name for p in step4.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    resolved = yaml.safe_load((tmp_path / "out" / "resolved_config.yaml").read_text())
    assert resolved["world_size"] == 2
