"""`data prepare` split over hosts (data/hosts.py) without the namespace cluster: the shares' balance, the errors of a
host that cannot see the shared directory or of a launch that left shards missing, and `--srun` against a stand-in
`srun` that starts one process per "node" the way Slurm does (SLURM_NODEID), byte-identical to a one-host prepare.
The pdsh/ssh path across real hosts is in test_multihost.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deepseek_ds.data import DataError
from deepseek_ds.data.hosts import SHARES_DIR, deal, finish_shares, run_share, write_shares
from deepseek_ds.data.prepare import finish, planned, run_tasks
from deepseek_ds.launcher.per_host import HostJob, check_hosts
from deepseek_ds.utils.errors import UserError

pytestmark = pytest.mark.unit


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def corpus(tmp_path: Path, docs: int = 40) -> list[str]:
    """Text files of unequal sizes, so that the shards differ in size."""
    rng = np.random.default_rng(0)
    root = tmp_path / "corpus"
    root.mkdir()
    for k in range(docs):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "epsilon", "zeta"], int(rng.integers(50, 2000)))
        (root / f"doc{k:03d}.txt").write_text(" ".join(words) + "\n")
    return [str(root)]


OPTIONS = dict(vocab_size=300, shard_mb=0.01, progress=False, valid_fraction=0.1)


def test_shares_are_balanced_and_cover_every_shard_once(tmp_path):
    with planned(corpus(tmp_path), str(tmp_path / "out"), **OPTIONS) as (prep, _):
        pass
    sizes = {t.name: int(t.docs.size.sum()) for t in prep.tasks}
    for hosts in (1, 3, 4):
        shares = deal(prep.tasks, hosts)
        names = sorted(t.name for share in shares for t in share)
        assert names == sorted(sizes)
        loads = [sum(sizes[t.name] for t in share) for share in shares]
        assert max(loads) - min(loads) <= max(sizes.values()), loads  # within one shard of each other


def test_a_dead_writers_temporaries_go_when_the_shards_are_done(tmp_path):
    """A host killed mid-file leaves `.{shard file}.{random}.tmp` (utils.fs's atomic write); the re-run's finish
    removes it, so the output is a one-host prepare's files, and keeps a temporary younger than its plan (a racing
    run's) and anything that is no shard file's."""
    out = tmp_path / "out"
    with planned(corpus(tmp_path), str(out), **OPTIONS) as (prep, pool):
        run_tasks(prep.tasks, pool, False)
    reference = tree(out)
    name = prep.tasks[0].name
    dead, racing, other = out / f".{name}.bin.k3x9q2_a.tmp", out / f".{name}.idx.ab12cd34.tmp", out / ".notes.x.tmp"
    for path in (dead, racing, other):
        path.write_bytes(b"partial")
    for path in (dead, other):
        os.utime(path, (prep.started - 60, prep.started - 60))
    finish(prep)
    assert not dead.exists() and racing.exists() and other.exists()
    racing.unlink()
    other.unlink()
    assert {k: v for k, v in tree(out).items() if k != "meta.json"} == reference


def test_a_host_without_the_shared_directory_and_a_launch_with_shards_missing_fail_in_one_line(tmp_path):
    with planned(corpus(tmp_path), str(tmp_path / "out"), **OPTIONS) as (prep, _):
        pass
    with pytest.raises(DataError, match="does not see .*host-000.pkl.*every host mounts at the same path"):
        run_share(tmp_path / "elsewhere", 0)
    shares_dir, todo = write_shares(prep, 2)
    assert len(todo) == len(prep.tasks) > 2
    print(run_share(shares_dir, 0))  # host 1 of 2 done, host 2 never ran
    with pytest.raises(DataError, match=rf"^\d+ of {len(prep.tasks)} shards of .* are missing .*re-run the same "
                                        "command: it prepares only the missing shards"):
        finish_shares(prep, shares_dir)
    assert not (prep.out / "meta.json").exists()
    # The re-run deals only what host 2 left undone.
    _, left = write_shares(prep, 2)
    assert 0 < len(left) < len(todo) and {t.name for t in left} == {t.name for t in deal(todo, 2)[1]}


FAKE_SRUN = """#!/usr/bin/env bash
# Slurm's srun as `data prepare --srun` calls it: --nodes=N --ntasks-per-node=1 ... CMD: one CMD per node with its
# SLURM_NODEID, all at once; fails when one fails, as --kill-on-bad-exit=1 has it.
nodes=1
while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
pids=()
for ((k = 0; k < nodes; k++)); do SLURM_NODEID=$k "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""


def test_srun_over_two_nodes_is_byte_identical_to_one_host(tmp_path):
    inputs = corpus(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    args = ["--input", *inputs, "--vocab-size", "300", "--shard-mb", "0.01", "--valid-fraction", "0.1",
            "--no-progress", "--workers", "2"]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_NNODES": "2"}
    on_nodes = subprocess.run([sys.executable, "-m", "deepseek_ds", "data", "prepare", "--out", str(tmp_path / "srun"),
                               "--srun", *args], env=env, capture_output=True, text=True, timeout=300)
    assert on_nodes.returncode == 0, on_nodes.stdout + on_nodes.stderr
    assert "host 1 of 2:" in on_nodes.stdout and "host 2 of 2:" in on_nodes.stdout
    one = subprocess.run([sys.executable, "-m", "deepseek_ds", "data", "prepare", "--out", str(tmp_path / "one"), *args],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    assert not (tmp_path / "srun" / SHARES_DIR).exists()
    reference = tree(tmp_path / "one")
    assert len(reference) > 10 and tree(tmp_path / "srun") == reference



def test_srun_outside_an_allocation_is_refused_before_anything_starts(monkeypatch):
    for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match="^--srun starts one process per node of a Slurm allocation: run it inside"):
        check_hosts(HostJob(srun=True), "unused")
