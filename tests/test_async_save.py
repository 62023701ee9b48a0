"""checkpoint.async against the step after it: the background save's copy of the state overlaps the next step's
forward and backward, and the update waits for it (async_save.AsyncSaver). With the copy started only once the
update is due, the background tag still holds, bitwise, the state a synchronous save of the same step holds; with
the hold off it does not (the check can fail). One rank on the real engine: tests/async_save_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepseek_ds.utils.net import free_port
from helpers import ROOT, launch_env

pytestmark = pytest.mark.launch


def test_the_update_after_a_background_save_waits_for_its_copy(data_dir, tmp_path):
    result = tmp_path / "async.json"
    env = {**launch_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.path.join(ROOT, "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sets = [f"data.path={data_dir}", "eval.interval=0", "checkpoint.interval=0", "checkpoint.async=true",
            "checkpoint.keep=4", f"train.output_dir={tmp_path / 'run'}"]
    cmd = [sys.executable, os.path.join(ROOT, "tests", "async_save_worker.py"), str(result),
           "--config", "recipes/tiny-v3.yaml", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = json.loads(result.read_text())
    assert out["step_changed_state"]  # the step after the save moved the weights and Adam's moments
    assert out["held_equal"], "the background tag does not hold the state of its step"
    assert out["update_wait_s"] > 0  # the update waited for the copy (which began only once the update was due)
    assert not out["unheld_equal"]  # without the hold the copy takes the updated state
    assert out["tags_verify"]
