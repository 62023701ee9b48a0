"""Checkpoints survive the whole job being killed: SIGKILL to the launcher's process group at seeded random moments
while it saves every step, twice in a row, the relaunch resuming, the second time saving in the background
(checkpoint.async); after every kill each complete tag verifies (sizes and checksums), and the final resume to the
end (from the background writer's newest tag, saving in the background too) gives the straight run's losses bitwise
(conftest.py `straight`, with dropout: the ranks' RNG states survive the kills too)."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from deepseek_ds.checkpoint.format import complete_tags
from deepseek_ds.checkpoint.integrity import check_tag
from deepseek_ds.utils.net import free_port
from helpers import BIN, ROOT, STRAIGHT_STEPS, cli, kill_job, launch_env, losses, read_metrics, resuming_sets, run_ranks

STEPS = STRAIGHT_STEPS  # the straight run's: its losses are the reference
# Two kills, a fresh job's and a resumed one's (which took over the dead job's lock), then the resume to the end. A
# third kill was the second round again (a resumed job killed at another random moment) for one more launch: what a
# kill can break there (a tag half written, the lock, the saved RNG and optimizer states) is the same in both.
KILLS = 2
SEED = 14  # the random moments, reproducible


def _args(out: Path, data_dir: str, background: bool) -> list[str]:
    """train.py on the straight run's settings, saving every step (in the background: checkpoint.async)."""
    args = ["train.py", "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}"]
    for s in resuming_sets(data_dir, STEPS, 1) + ([f"checkpoint.async={str(background).lower()}"]):
        args += ["--set", s]
    return args


def _newest_checkpoint(ckpt: Path) -> int:
    return max((int(t[4:]) for t in complete_tags(str(ckpt))), default=0)


def _files_in(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def _kill_while_saving(out: Path, data_dir: str, rng: random.Random, background: bool) -> None:
    """Launch (resuming whatever is there), then SIGKILL the launcher and every rank at once (their process group) at
    a seeded moment of the run's own progress: while step t's save is being written (its `.partial` directory holding
    at least k files) or just after step t is published, t two to four steps past the resume point and only once a
    newer checkpoint than the resume point is published (so every relaunch gets further, and none reaches the end).
    A moment in the run's progress, not in seconds: a faster or slower host kills at the same place."""
    ckpt = out / "checkpoints"
    resumed_at = _newest_checkpoint(ckpt)
    target = min(resumed_at + rng.randint(2, 4), STEPS - 1)
    files = rng.choice([0, 1, 2, 4, None])  # None: once step `target` is published
    partial = ckpt / f".step{target:08d}.partial"

    def reached() -> bool:
        newest = _newest_checkpoint(ckpt)
        if newest >= target:
            return True
        return newest > resumed_at and files is not None and partial.is_dir() and _files_in(partial) >= files

    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    proc = subprocess.Popen(cmd + _args(out, data_dir, background), cwd=ROOT, env=launch_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not reached():
        assert proc.poll() is None, f"the job ended (status {proc.returncode}) before it could be killed"
        assert time.monotonic() < deadline, f"step {target} not saved within 300 s"
        time.sleep(0.005)
    assert proc.poll() is None, "the job finished before the kill: raise STEPS"
    kill_job(proc)


@pytest.mark.launch
def test_sigkill_at_random_moments_while_saving_every_step(tmp_path, data_dir, straight):
    straight = losses(straight)
    assert sorted(straight) == list(range(1, STEPS + 1))

    out, rng = tmp_path / "killed", random.Random(SEED)
    ckpt = out / "checkpoints"
    newest = []
    for kill in range(KILLS):
        _kill_while_saving(out, data_dir, rng, background=kill > 0)
        tags = complete_tags(str(ckpt))
        assert tags, "killed before the first checkpoint"
        for tag in tags:  # every complete tag verifies, checksums included
            check = check_tag(str(ckpt / tag))
            assert check.ok and check.recorded, f"{tag} after a kill: {check.problem}"
        assert cli(["checkpoint", "verify", str(ckpt)]) == 0
        newest.append(int(tags[-1][4:]))
    assert newest == sorted(newest) and newest[-1] < STEPS  # each relaunch got further, none finished

    final = run_ranks(2, _args(out, data_dir, background=True))
    log = final.stdout + final.stderr
    assert f"resumed from step{newest[-1]:08d} at step {newest[-1]}" in log
    assert f"saved checkpoint step {STEPS} in the background" in log  # the end waited for it
    assert complete_tags(str(ckpt))[-1] == f"step{STEPS:08d}"
    assert "taking over the stale lock" in log  # the killed job's lock: its pid is dead on this host
    assert losses(read_metrics(str(out))) == straight  # bitwise, the steps after every resume included
    assert cli(["checkpoint", "verify", str(ckpt)]) == 0
