"""A JIT-build lock that a killed build left behind is one error naming the file (torch would wait on it forever);
a lock that a live process holds, as torch's FileBaton holds it during a build, is waited for with a line saying so;
the training entry point checks before anything loads an op."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from deepseek_ds.training.main import main as rank_main
from deepseek_ds.utils.jit_lock import StaleJitLock, check_jit_locks, extensions_root
from helpers import ROOT

# torch's own baton, as cpp_extension's build takes it: created with O_EXCL and held open until the build ends.
HOLDER = textwrap.dedent("""
    import sys, time
    from torch.utils.file_baton import FileBaton
    baton = FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    if sys.argv[3] == "release":
        baton.release()
""")


def _holder(lock, seconds: float, release: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(seconds), "release" if release else "die"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def local_fs(monkeypatch):
    """tmp_path as a filesystem no other host shares, whatever /tmp is here (9p, NFS, ... would make check_jit_locks
    wait for an unseen holder on another host)."""
    from deepseek_ds.utils import jit_lock

    monkeypatch.setattr(jit_lock, "_network_fs", lambda path: False)


@pytest.mark.unit
def test_a_lock_no_process_holds_is_an_error_naming_the_file(tmp_path, local_fs):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    start = time.monotonic()
    with pytest.raises(StaleJitLock, match=rf"{lock} is left by a JIT build of DeepSpeed's 'fused_adam' op that was "
                                           rf"killed .*remove it \(rm {lock}\).*TORCH_EXTENSIONS_DIR="):
        check_jit_locks(str(tmp_path), say=pytest.fail, poll_s=0.05, grace_s=0.05)
    assert time.monotonic() - start < 5


@pytest.mark.unit
def test_a_compiler_the_killed_build_left_running_is_named(tmp_path, local_fs):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    ninja = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=lock.parent)  # its ninja
    try:
        with pytest.raises(StaleJitLock, match=rf"rm {lock}.*compiler \(process {ninja.pid}\) still runs there"):
            check_jit_locks(str(tmp_path), say=pytest.fail, poll_s=0.05, grace_s=0.05)
    finally:
        ninja.kill()
        ninja.wait()


@pytest.mark.unit
def test_a_live_build_is_waited_for_with_a_line_and_its_death_is_an_error(tmp_path, local_fs):
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    said = []
    proc = _holder(lock, 1.5, release=True)
    start = time.monotonic()
    check_jit_locks(str(tmp_path), say=said.append, poll_s=0.05, grace_s=0.05)
    waited = time.monotonic() - start
    assert proc.wait(10) == 0 and not lock.exists()
    assert said == [f"deepseek-ds: waiting for the JIT build of DeepSpeed's 'cpu_adam' op to finish: {lock} (held by "
                    f"process {proc.pid})"]
    assert 0.5 < waited < 10  # it waited for the holder's release, not for a timeout
    # A build killed while this process waits on it leaves the file: the wait ends in the error.
    proc = _holder(lock, 1.0, release=False)
    with pytest.raises(StaleJitLock, match=rf"rm {lock}"):
        check_jit_locks(str(tmp_path), say=said.append, poll_s=0.05, grace_s=0.05)
    assert proc.wait(10) == 0 and lock.exists()


@pytest.mark.unit
def test_the_training_entry_point_refuses_a_stale_lock_before_loading_ops(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert extensions_root() == str(tmp_path / "ext")
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    status = rank_main(["--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"deepseek-ds: error: {lock} is left by a JIT build")
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything


@pytest.mark.unit
def test_on_a_shared_filesystem_an_unseen_holder_is_waited_for_until_its_directory_stops_changing(tmp_path,
                                                                                                monkeypatch):
    from deepseek_ds.utils import jit_lock

    monkeypatch.setattr(jit_lock, "_network_fs", lambda path: True)  # as on NFS: another host's build is invisible
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    said = []
    start = time.monotonic()
    with pytest.raises(StaleJitLock, match=rf"rm {lock}"):
        check_jit_locks(str(tmp_path), say=said.append, poll_s=0.05, grace_s=0.05, idle_s=1.0)
    assert 1.0 <= time.monotonic() - start < 10
    assert len(said) == 1 and "no process of this host holds it" in said[0] and "after 1 s without a change" in said[0]


@pytest.mark.unit
@pytest.mark.parametrize("users", [False, True])
def test_importing_the_package_sets_the_checkout_s_jit_cache_for_its_launches_unless_the_user_set_one(users,
                                                                                                      tmp_path):
    """`source .venv/bin/activate; deepseek-ds train` built DeepSpeed's ops into ~/.cache/torch_extensions: only
    scripts/setup.sh set the directory. Now importing the package does (a checkout's .cache/torch_extensions), so
    the environment every launch gets carries it, and torch builds there; a user's own directory is left alone."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    want = str(tmp_path / "theirs") if users else os.path.join(ROOT, ".cache", "torch_extensions")
    if users:
        env["TORCH_EXTENSIONS_DIR"] = want
    code = ("from deepseek_ds.utils.system import launch_env; from deepseek_ds.utils.jit_lock import extensions_root; "
            "print(launch_env().get('TORCH_EXTENSIONS_DIR')); print(extensions_root())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # another directory than the checkout: the package decides, not the cwd
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [want, want]
