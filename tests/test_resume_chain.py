"""Issue 14: a run resumed again and again trains exactly as the straight run, step for step and bit for bit.

The drift came from DeepSpeed's CPU Adam kernel: it keeps beta^t as a float32 running product, which a resume
recomputed with pow(); 0.95^6 is where the two first part (tested below, in-process and through 3 launches).
With attention dropout on, the chain also checks that every resume restores each rank's torch RNG.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

from deepseek_ds.checkpoint.state import replay_cpu_adam_steps
from deepseek_ds.config import load_run_config
from helpers import STRAIGHT_STEPS, resuming_sets, train, training_loss
from reference import reference_model

BETAS = (0.9, 0.95)  # the recipes' AdamW betas (train.beta1, train.beta2)
# train.steps of the chain's launches: resumes at steps 3 and 6, the second from a checkpoint a resumed run wrote,
# each followed by optimizer steps whose beta power parts from pow() (6; 7 and 8). Without the replay the chain fails
# at step 8 (aux_loss). The chain was 2, 4, 6, 8: one more launch, for an early resume that exercised nothing more.
CHAIN = (3, 6, 8)
COMPARED = ("loss", "aux_loss", "grad_norm", "lr")


@pytest.mark.unit
def test_running_beta_power_parts_from_pow_at_step_6():
    """Why a resume at step 5 or later drifted from the step after next: the kernel's running product is not pow()
    from 0.95^6 on (the C++ code raises the float32 beta to an integer power in double precision)."""
    beta = np.float32(BETAS[1])
    running = [beta]
    for _ in range(7):
        running.append(np.float32(running[-1] * beta))
    recomputed = [np.float32(float(beta) ** step) for step in range(1, 9)]
    assert [a == b for a, b in zip(running, recomputed)] == [True] * 5 + [False] * 3


def _adam(param: torch.Tensor) -> DeepSpeedCPUAdam:
    return DeepSpeedCPUAdam([param], lr=1e-3, betas=BETAS, weight_decay=0.1)


def _steps(opt: DeepSpeedCPUAdam, param: torch.Tensor, grads: list[torch.Tensor]) -> None:
    for grad in grads:
        param.grad = grad.clone()
        opt.step()


@pytest.mark.unit
def test_replay_makes_a_resumed_cpu_adam_step_bitwise():
    """Seven steps straight against six, a new optimizer loading their state, and the seventh: equal bit for bit
    with the replay, and not without it (so the check can fail)."""
    torch.manual_seed(0)
    start = torch.randn(4096)
    grads = [torch.randn(4096) for _ in range(7)]
    straight = start.clone()
    _steps(_adam(straight), straight, grads)

    results = []
    for replay in (False, True):
        saved = start.clone()
        first = _adam(saved)
        _steps(first, saved, grads[:6])
        resumed = saved.clone()
        second = _adam(resumed)
        second.load_state_dict(first.state_dict())
        assert second.state[resumed]["step"] == 6
        if replay:
            replay_cpu_adam_steps(second)
        _steps(second, resumed, grads[6:])
        results.append(torch.equal(resumed, straight))
    assert results == [False, True]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, straight) -> dict:
    """recipes/tiny-v3.yaml (ZeRO-1, 2 ranks, MoE with the router-bias update and the balance loss, dropout) as a
    chain of launches into one output directory, each raising train.steps, against the first steps of the straight
    run (conftest.py): the same schedule, since the warm-up outlasts both (asserted through `lr`)."""
    out = tmp_path_factory.mktemp("resume_chain") / "chain"
    for steps in CHAIN:
        chain = train(2, str(out), resuming_sets(data_dir, steps, 1))
    log = (out / "logs" / "rank0.log").read_text()
    return {"straight": [r for r in straight if r["step"] <= CHAIN[-1]], "chain": chain, "log": log}


@pytest.mark.launch
def test_chain_of_resumes_is_bitwise(runs):
    assert CHAIN[-1] <= STRAIGHT_STEPS
    for step in CHAIN[:-1]:
        assert f"resumed from step{step:08d} at step {step}" in runs["log"]
    straight = {r["step"]: [r[k] for k in COMPARED] for r in runs["straight"]}
    chain = {r["step"]: [r[k] for k in COMPARED] for r in runs["chain"]}
    assert sorted(chain) == sorted(straight) == list(range(1, CHAIN[-1] + 1))
    for step in straight:  # ==, not approx: the steps after each resume must be the straight run's
        assert chain[step] == straight[step], f"step {step}: chain {chain[step]} != straight {straight[step]}"


@pytest.mark.launch
def test_dropout_is_really_on_in_the_straight_run(straight, data_dir):
    """The chain's RNG check can fail only if dropout draws from the RNG: step 1 (the seeded initial weights) logs
    another loss than the same model without dropout (transformers, in-process), which training would log to ~1e-5."""
    cfg = load_run_config("recipes/tiny-v3.yaml", resuming_sets(data_dir, STRAIGHT_STEPS, 0))
    model, _ = reference_model(cfg)
    without_dropout = training_loss(model.eval(), data_dir, 1, seq_len=cfg.data.seq_len)
    print(f"step 1: {straight[0]['loss']:.6f} with dropout, {without_dropout:.6f} without")
    assert abs(straight[0]["loss"] - without_dropout) > 1e-4
