"""The equivalence check can fail: each of a handful of deliberate subtle bugs, patched into the product code of one
run (tests/mutations_worker.py), makes the comparison with the single-process reference fail, while the same runs
unmutated pass it. All of them train in ONE 2-rank launch (ZeRO-1, the real training loop, test_equivalence's
settings).

The comparison is test_equivalence's (the losses within 1e-5 relative) plus what the run logs that a few steps' losses
can be blind to: each step's gradient norm (Adam normalises a gradient's size away, so a scaled gradient hardly moves
the next losses) and the router-bias statistics the loop logs after each bias update (a sign-flipped update moves
the biases by 2 x gamma but the routing, and so the loss, only where a token was within 2 x gamma of a tie). Measured
here: the flipped bias moved step 2's loss by 7e-5 and LoRA's x4 scaling by 1.5e-3 (both 0 at step 1), the gradient
norm x4 at step 1; the controls' gradient norms within 3.3e-6 of the reference's."""

from __future__ import annotations

import re

import pytest
import torch

from deepseek_ds.config import load_run_config
from helpers import read_metrics, router_biases, train_layouts
from reference import lora_reference_losses, reference_losses

pytestmark = pytest.mark.launch

STEPS = 3
# test_equivalence.SETS: its seed and Adam eps keep the reference clear of routing near ties.
SETS = [f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64",
        "train.warmup_steps=0", "checkpoint.interval=0", "eval.interval=0", "train.eps=1e-5", "train.seed=7"]
# test_lora.SETS's adapters, on a base that is tiny-v3 at its seeded initialisation; the routing stays the base's.
LORA = ["model.preset=null", "lora.r=4", "lora.alpha=8", "moe.bias_update_speed=0"]
TOLERANCE = 1e-5
# The logged gradient norm: the controls' agree to ~3e-6; the mutations it must catch move it by ~5e-5 (one rank's
# gradient x (1 + 1e-4)) and 4x (LoRA's scaling). test_equivalence holds every layout to the same bound.
GRAD_NORM_TOLERANCE = 1e-5
# Each bug and the comparison that must catch it (test_equivalence's loss comparison wherever it can).
MUTATIONS = {
    "loss-scale": "loss",      # rank 1's loss x (1 + 1e-4): the logged loss moves by ~5e-5
    "grad-scale": "grad_norm",  # rank 1's gradient x (1 + 1e-4), its loss unchanged: the norm moves by ~5e-5
    "token-count": "loss",     # one micro-batch of four left out of the token count: the mean's denominator
    "sample-swap": "loss",     # the same samples over the run, two of them in each other's step
    "bias-sign": "bias",       # b_i moves away from balance
    "lora-scaling": "grad_norm",  # alpha / r = 2 becomes alpha = 8: the adapters' gradients x 4 (B starts at 0)
}
CONTROLS = ("control", "lora-control")


def is_lora(name: str) -> bool:
    return name.startswith("lora-")


def extra(base_dir: str, name: str) -> list[str]:
    return [f"model.path={base_dir}", *LORA] if is_lora(name) else []


def config(data_dir: str, base_dir: str, name: str):
    return load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={data_dir}", *extra(base_dir, name)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, lora_base) -> dict:
    """name -> (metrics records, initial adapters or None): every run in one launch of mutations_worker.py."""
    names = ["control", *[n for n in MUTATIONS if not is_lora(n)], "lora-control", *[n for n in MUTATIONS if is_lora(n)]]
    layouts = [(n, "ds_configs/zero1.json", extra(lora_base, n)) for n in names]
    dirs = train_layouts(2, tmp_path_factory.mktemp("mutations"), layouts, SETS + [f"data.path={data_dir}"],
                         worker="tests/mutations_worker.py")
    return {n: (read_metrics(str(d)), torch.load(d / "initial_adapters.pt") if is_lora(n) else None)
            for n, d in dirs.items()}


@pytest.fixture(scope="module")
def references(runs, data_dir, lora_base) -> dict:
    """"main" and "lora": the reference's losses, gradient norms and router-bias statistics (per step)."""
    out = {}
    norms, log = [], []
    out["main"] = {"loss": reference_losses(config(data_dir, lora_base, "control"), data_dir, log, grad_norms=norms),
                   "grad_norm": norms,
                   "bias": [bias_stats(step["biases"]) for step in log]}
    norms = []
    out["lora"] = {"loss": lora_reference_losses(config(data_dir, lora_base, "lora-control"), lora_base, data_dir,
                                                 runs["lora-control"][1], grad_norms=norms), "grad_norm": norms}
    return out


def bias_stats(biases: dict[str, torch.Tensor]) -> dict[str, float]:
    """The reference's router biases (by transformers block name, model.layers.L.mlp) as the training loop logs
    them: moe/layer{L}/bias_{min,max,mean,std}."""
    out = {}
    for block, b in biases.items():
        layer = int(re.search(r"layers\.(\d+)\.mlp", block).group(1))
        b = b.double()
        for stat, value in zip(("min", "max", "mean", "std"), (b.min(), b.max(), b.mean(), b.std(unbiased=False))):
            out[f"moe/layer{layer}/bias_{stat}"] = value.item()
    return out


def mismatches(records: list[dict], reference: dict) -> list[str]:
    """What differs from the reference beyond TOLERANCE: empty when the run passes."""
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    found = []
    for key, tolerance in (("loss", TOLERANCE), ("grad_norm", GRAD_NORM_TOLERANCE)):
        got = [r[key] for r in records]
        if got != pytest.approx(reference[key], rel=tolerance):
            found.append(f"{key}: {got} vs reference {reference[key]}")
    if "bias" in reference:
        logged = list(router_biases(records).values())
        keys = sorted(reference["bias"][0])
        assert logged and all(sorted(step) == keys for step in logged), "no router-bias statistics"
        got, want = [[step[k] for k in keys] for step in logged], [[step[k] for k in keys] for step in reference["bias"]]
        # The biases move in steps of gamma (1e-3): a bias that is off is off by more than roundoff.
        if any(g != pytest.approx(w, rel=TOLERANCE, abs=1e-9) for g, w in zip(got, want)):
            found.append(f"bias: {got} vs reference {want} ({keys})")
    return found


@pytest.mark.parametrize("name", CONTROLS)
def test_the_unmutated_runs_pass(name, runs, references):
    records, _ = runs[name]
    reference = references["lora" if is_lora(name) else "main"]
    assert len(set(reference["loss"])) == STEPS  # the reference trains: every step's loss differs
    assert mismatches(records, reference) == []


@pytest.mark.parametrize("name,caught_by", MUTATIONS.items(), ids=list(MUTATIONS))
def test_each_mutation_fails_the_equivalence_check(name, caught_by, runs, references):
    records, initial = runs[name]
    if is_lora(name):  # the same start as the control: only the bug differs
        control = runs["lora-control"][1]
        assert set(initial) == set(control) and all(torch.equal(initial[k], control[k]) for k in initial)
    found = mismatches(records, references["lora" if is_lora(name) else "main"])
    assert any(f.startswith(caught_by + ":") for f in found), f"{name} not caught by the {caught_by} comparison: {found}"
