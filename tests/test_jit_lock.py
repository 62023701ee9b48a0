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

# torch's own baton, as cpp_extension's build takes it: created with O_EXCL and held open until the build ends,
# here until the test says "release" (or "die": exit without removing it, as a killed build does).
HOLDER = textwrap.dedent("""
    import sys
    from torch.utils.file_baton import FileBaton
    baton = FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("held", flush=True)
    if sys.stdin.readline().strip() == "release":
        baton.release()
""")


def _holder(lock) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


class _Clock:
    """jit_lock's time module: sleep() records the wait and advances time() by it at once, and at the `at`-th sleep
    tells `holder` what to do and waits until it has done it. What the check does is set in its own polls, not in
    how fast this machine runs it."""

    def __init__(self, holder: subprocess.Popen | None = None, at: int = 0, then: str = ""):
        self.slept: list[float] = []
        self.start, self.holder, self.at, self.then = time.time(), holder, at, then

    def time(self) -> float:
        return self.start + sum(self.slept)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        assert len(self.slept) < 10_000, "still waiting after 10,000 polls"
        if self.holder is not None and len(self.slept) == self.at:
            self.holder.stdin.write(self.then + "\n")
            self.holder.stdin.flush()
            assert self.holder.wait(60) == 0


@pytest.fixture
def clock(monkeypatch):
    """jit_lock's clock, with what the lock's holder does at which poll set by the test."""
    from deepseek_ds.utils import jit_lock

    def install(*args) -> _Clock:
        fake = _Clock(*args)
        monkeypatch.setattr(jit_lock, "time", fake)
        return fake
    return install


@pytest.fixture
def local_fs(monkeypatch):
    """tmp_path as a filesystem no other host shares, whatever /tmp is here (9p, NFS, ... would make check_jit_locks
    wait for an unseen holder on another host)."""
    from deepseek_ds.utils import jit_lock

    monkeypatch.setattr(jit_lock, "_network_fs", lambda path: False)


@pytest.mark.unit
def test_a_lock_no_process_holds_is_an_error_naming_the_file(tmp_path, local_fs, clock):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    waits = clock()
    with pytest.raises(StaleJitLock, match=rf"{lock} is left by a JIT build of DeepSpeed's 'fused_adam' op that was "
                                           rf"killed .*remove it \(rm {lock}\).*TORCH_EXTENSIONS_DIR="):
        check_jit_locks(str(tmp_path), say=pytest.fail, poll_s=0.05, grace_s=0.05)
    assert waits.slept == [0.05]  # refused after torch's grace, without polling


@pytest.mark.unit
def test_a_compiler_the_killed_build_left_running_is_named(tmp_path, local_fs):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    ninja = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], cwd=lock.parent)  # its ninja
    try:
        with pytest.raises(StaleJitLock, match=rf"rm {lock}.*compiler \(process {ninja.pid}\) still runs there"):
            check_jit_locks(str(tmp_path), say=pytest.fail, poll_s=0.05, grace_s=0.05)
    finally:
        ninja.kill()
        ninja.wait()


@pytest.mark.unit
def test_a_live_build_is_waited_for_with_a_line_and_its_death_is_an_error(tmp_path, local_fs, clock):
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    said = []
    proc = _holder(lock)
    try:
        waits = clock(proc, 3, "release")  # the build ends during the third poll
        check_jit_locks(str(tmp_path), say=said.append, poll_s=0.05, grace_s=0.05)
        assert waits.slept == [0.05] * 3  # it waited, polling, for the holder's release, and returned after it
        assert proc.returncode == 0 and not lock.exists()
        assert said == [f"deepseek-ds: waiting for the JIT build of DeepSpeed's 'cpu_adam' op to finish: {lock} "
                        f"(held by process {proc.pid})"]
        # A build killed while this process waits on it leaves the file: the wait ends in the error.
        proc = _holder(lock)
        waits = clock(proc, 2, "die")
        with pytest.raises(StaleJitLock, match=rf"rm {lock}"):
            check_jit_locks(str(tmp_path), say=said.append, poll_s=0.05, grace_s=0.05)
        assert waits.slept == [0.05, 0.05, 0.05] and proc.returncode == 0 and lock.exists()  # 2 polls, torch's grace
    finally:
        proc.kill()
        proc.wait()


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
                                                                                                monkeypatch, clock):
    from deepseek_ds.utils import jit_lock

    monkeypatch.setattr(jit_lock, "_network_fs", lambda path: True)  # as on NFS: another host's build is invisible
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    said = []
    waits = clock()
    os.utime(lock, (waits.start, waits.start))  # its last change: now, on the check's clock
    with pytest.raises(StaleJitLock, match=rf"rm {lock}"):
        check_jit_locks(str(tmp_path), say=said.append, poll_s=0.05, grace_s=0.05, idle_s=1.0)
    assert 1.0 < sum(waits.slept) < 1.0 + 0.05 + 1e-9  # refused at the first poll past idle_s, not before
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
