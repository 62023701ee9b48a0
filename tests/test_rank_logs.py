"""A rank that dies of a bug leaves its traceback in its own logs/rankN.log (Slurm jobs are read post-mortem from
files), besides the console."""

import os

import pytest

from helpers import run_ranks

pytestmark = pytest.mark.launch

# train.py with a bug at optimizer step 2 on rank 1 (the loop's step function is patched in the rank).
INJECT = '''
import os, sys
from deepseek_ds.training import loop
from deepseek_ds.training.main import main

_step, calls = loop._local_step, [0]

def buggy_step(run, micro_batches):
    calls[0] += 1
    if calls[0] == 2 and os.environ["RANK"] == "1":
        raise RuntimeError("injected bug at step 2")
    return _step(run, micro_batches)

loop._local_step = buggy_step
sys.exit(main())
'''


def test_a_bug_leaves_its_traceback_in_the_rank_log(tmp_path, data_dir):
    script = tmp_path / "inject_bug.py"
    script.write_text(INJECT)
    out = tmp_path / "run"
    proc = run_ranks(2, [str(script), "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}",
                         "--set", f"data.path={data_dir}", "--set", "train.steps=4", "--set", "data.seq_len=32",
                         "--set", "train.dist_timeout_s=60"], check=False, timeout=300)
    assert proc.returncode != 0
    with open(os.path.join(out, "logs", "rank1.log")) as f:
        log = f.read()
    assert "this rank failed:" in log and "Traceback (most recent call last)" in log
    assert "RuntimeError: injected bug at step 2" in log
    assert "injected bug" not in open(os.path.join(out, "logs", "rank0.log")).read()
