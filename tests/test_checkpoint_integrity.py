"""Checkpoints that survive races and damage: one job per checkpoint.dir (a lock naming its holder, stale locks taken
over), every file's size and checksum recorded and verified, a damaged newest tag skipped at resume (and never
counted by retention), `deepseek-ds checkpoint verify`."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from deepseek_ds.checkpoint import integrity
from deepseek_ds.checkpoint.format import FORMAT_VERSION, META, CheckpointError, complete_tags, tag_for
from deepseek_ds.checkpoint.integrity import (
    FILES,
    VISIBLE_WAIT_S,
    check_tag,
    merge_records,
    newest_verified_tag,
    record_written,
)
from deepseek_ds.checkpoint.lock import LOCK, acquire
from deepseek_ds.checkpoint.state import restore_rng, rng_path, rng_state
from deepseek_ds.config import load_ds_config, run_config_from_dict, validate
from deepseek_ds.config.deepspeed_json import asynchronous_checkpoint_engines
from deepseek_ds.utils.net import free_port
from helpers import BIN, ROOT, cli, launch_env, losses, read_metrics, refused, resuming_sets, run_ranks
from tag_reference import read_back_record

STALE_S = 300  # checkpoint.lock_stale_s's default


def _fake_tag(ckpt: Path, step: int, recorded: bool = True) -> Path:
    """A published tag with two files (one in a sub-directory) and a checkpoint.json recording them."""
    d = ckpt / tag_for(step)
    (d / "rng").mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 40)
    (d / "rng" / "rank_00000.pt").write_bytes(b"rng" * 10)
    meta = {"format_version": FORMAT_VERSION, "tag": tag_for(step), "step": step}
    if recorded:
        meta[FILES] = read_back_record(d)
    (d / META).write_text(json.dumps(meta))
    return d


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


def _write_lock(ckpt: Path, host: str, pid: int, age_s: float = 0.0) -> Path:
    ckpt.mkdir(parents=True, exist_ok=True)
    path = ckpt / LOCK
    path.write_text(json.dumps({"host": host, "pid": pid, "since": "2026-01-01T00:00:00+0000", "token": "theirs"}))
    if age_s:
        old = time.time() - age_s
        os.utime(path, (old, old))
    return path


class _Clock:
    """The time module of the code under test: sleep() advances monotonic() at once and then runs `meanwhile(now)`
    (what other processes do in that time), so a bound is checked on the clock the code reads, not on how loaded
    the machine is. A wait still going after `limit_s` of it fails the test instead of spinning on."""

    def __init__(self, meanwhile=lambda now: None, limit_s: float = 3600.0):
        self.now, self.meanwhile, self.limit_s = 0.0, meanwhile, limit_s

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        assert self.now <= self.limit_s, f"still waiting after {self.limit_s:.0f} s of its clock"
        self.meanwhile(self.now)


# ----------------------------------------------------------------------------------------------- lock
@pytest.mark.unit
def test_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    lock = acquire(str(tmp_path / "ckpt"), STALE_S)
    holder = json.loads((tmp_path / "ckpt" / LOCK).read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(CheckpointError) as err:
        acquire(str(tmp_path / "ckpt"), STALE_S)
    message = str(err.value)
    assert f"host {socket.gethostname()}, pid {os.getpid()}, since {holder['since']}" in message
    assert "another checkpoint.dir" in message  # the fix
    lock.release()
    assert not (tmp_path / "ckpt" / LOCK).exists()
    acquire(str(tmp_path / "ckpt"), STALE_S).release()  # free again once released


@pytest.mark.unit
def test_lock_of_a_dead_pid_on_this_host_is_taken_over(tmp_path, caplog):
    dead = _dead_pid()
    _write_lock(tmp_path, socket.gethostname(), dead)
    with caplog.at_level(logging.WARNING):
        lock = acquire(str(tmp_path), STALE_S, logging.getLogger("test"))
    assert f"pid {dead}" in caplog.text and "no longer running" in caplog.text
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert [n for n in os.listdir(tmp_path) if n != LOCK] == []  # the stale lock is gone, no temporaries left
    lock.release()


@pytest.mark.unit
def test_lock_of_another_host_is_stale_only_without_heartbeat(tmp_path):
    _write_lock(tmp_path, "elsewhere", 1, age_s=STALE_S / 2)  # a live holder on a host we cannot check
    with pytest.raises(CheckpointError, match="host elsewhere, pid 1"):
        acquire(str(tmp_path), STALE_S)
    _write_lock(tmp_path, "elsewhere", 1, age_s=STALE_S * 2)
    acquire(str(tmp_path), STALE_S).release()


@pytest.mark.unit
def test_a_live_lock_is_refused_before_start_up_and_in_the_job(tmp_path):
    import torch.distributed as dist

    from deepseek_ds.checkpoint.lock import check_free, checkpoint_lock
    from deepseek_ds.checkpoint.resuming import resume

    ckpt = tmp_path / "ckpt"
    run = types.SimpleNamespace(cfg=run_config_from_dict({"checkpoint": {"dir": str(ckpt)}}), rank=0, world=1,
                                log=logging.getLogger("test"))
    check_free(str(ckpt), STALE_S)  # no lock: free
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="boom"), checkpoint_lock(run):
            assert json.loads((ckpt / LOCK).read_text())["pid"] == os.getpid()
            raise RuntimeError("boom")
        assert not (ckpt / LOCK).exists()  # released on the way out of an exception
        _write_lock(ckpt, socket.gethostname(), os.getpid())
        for refuse in (lambda: check_free(str(ckpt), STALE_S), lambda: checkpoint_lock(run).__enter__()):
            with pytest.raises(CheckpointError, match=f"in use by another job .host {socket.gethostname()}, "
                                                      f"pid {os.getpid()}, since 2026-01-01"):
                refuse()
        (ckpt / LOCK).unlink()
        _fake_tag(ckpt, 1)
        _truncate(ckpt / tag_for(1) / "mp_rank_00_model_states.pt")
        with pytest.raises(CheckpointError, match="no checkpoint in .* verifies"):  # not a silent fresh start
            resume(run)
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
def test_lock_stale_age_comes_from_checkpoint_lock_stale_s(tmp_path, caplog):
    from deepseek_ds.checkpoint.existing import check_existing_checkpoint

    ckpt = tmp_path / "ckpt"
    _write_lock(ckpt, "elsewhere", 1, age_s=100)  # a holder on another host, silent for 100 s
    default = run_config_from_dict({"checkpoint": {"dir": str(ckpt)}})
    with pytest.raises(CheckpointError, match="in use by another job .host elsewhere"):
        check_existing_checkpoint(default)  # 100 s < 300 s: still live
    impatient = run_config_from_dict({"checkpoint": {"dir": str(ckpt), "lock_stale_s": 60}})
    assert check_existing_checkpoint(impatient) is None  # stale at 60 s: free, nothing to resume
    with caplog.at_level(logging.WARNING):
        acquire(str(ckpt), impatient.checkpoint.lock_stale_s, logging.getLogger("test")).release()
    assert "taking over the stale lock" in caplog.text and "for 100 s (more than 60 s)" in caplog.text


# ----------------------------------------------------------------------------------------------- engines
@pytest.mark.unit
@pytest.mark.parametrize("section, key", [
    ({"checkpoint": {"writer": {"type": "fast", "decoupled": True}}}, "checkpoint.writer.decoupled = true"),
    ({"nebula": {"enabled": True}}, "'nebula'"),
    ({"datastates_ckpt": {}}, "'datastates_ckpt'"),  # DeepSpeed enables it for anything but false
])
def test_asynchronous_checkpoint_engines_are_refused_before_launch(section, key):
    ds = {**load_ds_config(os.path.join(ROOT, "ds_configs", "zero1.json")), **section}
    message = refused(run_config_from_dict({}), ds)
    assert key in message and "asynchronous" in message and "synchronous engine" in message
    assert message.count("\n  - ") == 1  # this one problem only


@pytest.mark.unit
def test_synchronous_checkpoint_engine_settings_pass():
    ds = {**load_ds_config(os.path.join(ROOT, "ds_configs", "zero1.json")),
          "checkpoint": {"writer": {"decoupled": False}}, "datastates_ckpt": False}
    assert asynchronous_checkpoint_engines(ds) == []  # explicit "off" is not an asynchronous engine
    validate(run_config_from_dict({}), ds, 1, cuda_available=False)  # and the run is accepted (no ConfigError)


# ----------------------------------------------------------------------------------------------- integrity
@pytest.mark.unit
def test_check_tag_finds_truncation_flipped_bytes_and_missing_files(tmp_path):
    d = _fake_tag(tmp_path, 1)
    check = check_tag(str(d))
    assert check.ok and check.files == 2 and check.bytes == 256 * 40 + 30
    _truncate(d / "rng" / "rank_00000.pt")
    assert check_tag(str(d)).problem == "rng/rank_00000.pt (15 bytes, 30 written)"
    (d / "rng" / "rank_00000.pt").write_bytes(b"rng" * 10)
    data = bytearray((d / "mp_rank_00_model_states.pt").read_bytes())
    data[100] ^= 1
    (d / "mp_rank_00_model_states.pt").write_bytes(bytes(data))
    assert check_tag(str(d), sizes_only=True).ok  # same size: only the checksum sees it
    assert "mp_rank_00_model_states.pt (checksum" in check_tag(str(d)).problem
    (d / "mp_rank_00_model_states.pt").unlink()
    assert check_tag(str(d)).problem == "mp_rank_00_model_states.pt (missing)"


@pytest.mark.unit
def test_ranks_split_a_tags_checksums_and_together_find_any_flipped_byte(tmp_path):
    """Resume: rank k of n checksums files k, k+n, ... (sizes all), so the damage is found by exactly one rank."""
    d = _fake_tag(tmp_path, 1)
    files = sorted(json.loads((d / META).read_text())[FILES])  # the recorded order: sorted paths
    for damaged in files:
        path = d / damaged
        data = bytearray(path.read_bytes())
        data[0] ^= 1
        path.write_bytes(bytes(data))
        found = [check_tag(str(d), part=(k, 2)).problem for k in (0, 1)]
        owner = files.index(damaged) % 2
        assert found[owner] == f"{damaged} (checksum differs from the one written)" and found[1 - owner] is None
        data[0] ^= 1
        path.write_bytes(bytes(data))
    _truncate(d / files[1])
    assert all(check_tag(str(d), part=(k, 2)).problem for k in (0, 1))  # sizes: every rank sees a truncation


@pytest.mark.unit
def test_newest_verified_tag_skips_damaged_ones_with_a_warning(tmp_path, caplog):
    for step in (1, 2, 3):
        _fake_tag(tmp_path, step)
    _truncate(tmp_path / tag_for(3) / "mp_rank_00_model_states.pt")
    (tmp_path / tag_for(2) / META).write_text('{"format_version": 1, "ta')  # cut short
    with caplog.at_level(logging.WARNING):
        assert newest_verified_tag(str(tmp_path), logging.getLogger("test")) == tag_for(1)
    assert f"{tag_for(3)} is damaged: mp_rank_00_model_states.pt (5120 bytes, 10240 written)" in caplog.text
    assert f"{tag_for(2)} is damaged: {META} (unreadable" in caplog.text


@pytest.mark.unit
def test_merged_records_equal_reading_the_tag_back(tmp_path):
    d = _fake_tag(tmp_path, 1)
    (d / "zero_to_fp32.py").write_text("# copied by DeepSpeed outside its checkpoint engine: nobody records it")
    rank0 = record_written(str(d), [str(d / "mp_rank_00_model_states.pt")])
    rank1 = record_written(str(d), [str(d / "rng" / "rank_00000.pt")])
    merged = merge_records(str(d), [{"host": "a", "files": rank0}, {"host": "b", "files": rank1}])
    assert merged == read_back_record(d)  # the independent reference: every file read back by one process
    assert list(merged) == ["mp_rank_00_model_states.pt", "rng/rank_00000.pt", "zero_to_fp32.py"]


@pytest.mark.unit
def test_unshared_checkpoint_dir_is_refused_naming_the_hosts(tmp_path, monkeypatch):
    # What rank 0 sees when checkpoint.dir is a local directory on each host: host-b's ranks wrote their files into
    # their own copy of the directory, which is not this one.
    here, there = _fake_tag(tmp_path / "host-a", 1), _fake_tag(tmp_path / "host-b", 1)
    (there / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x" * 100)
    records = [{"host": "host-a", "files": record_written(str(here), [str(here / "mp_rank_00_model_states.pt")])},
               {"host": "host-b", "files": record_written(str(there), [str(there / "rng" / "rank_00000.pt")])},
               {"host": "host-b", "files": record_written(
                   str(there), [str(there / "zero_pp_rank_1_mp_rank_00_optim_states.pt")])}]
    clock = _Clock()
    monkeypatch.setattr(integrity, "time", clock)
    with pytest.raises(CheckpointError) as err:
        merge_records(str(here), records)
    assert VISIBLE_WAIT_S <= clock.now <= VISIBLE_WAIT_S + 1.0  # looked again until the configured wait ran out
    message = str(err.value)
    assert "\n" not in message and f"checkpoint.dir {tmp_path / 'host-a'} is not shared between hosts" in message
    assert "rank 0 on host host-a does not see what ranks [2] on host(s) host-b wrote" in message
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt (missing, 100 written)" in message
    assert "filesystem every host mounts" in message  # the fix
    # rank 1's file exists here too, but with another size than it wrote: also not its file
    (here / "rng" / "rank_00000.pt").write_bytes(b"short")
    with pytest.raises(CheckpointError, match=r"ranks \[1, 2\] .*rank 1: rng/rank_00000.pt \(5 bytes, 30 written\)"):
        merge_records(str(here), records, wait_s=0.0)
    # A file that shows up while rank 0 is still looking (a network filesystem's caches catching up) is found.
    (here / "rng" / "rank_00000.pt").write_bytes(b"rng" * 10)
    late = here / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    clock = _Clock(lambda now: now >= 3.0 and not late.exists() and late.write_bytes(b"x" * 100))
    monkeypatch.setattr(integrity, "time", clock)
    assert set(merge_records(str(here), records)) >= {late.name} and clock.now == 3.0


@pytest.mark.unit
def test_retention_never_deletes_the_newest_intact_tag(tmp_path):
    from deepseek_ds.checkpoint.saving import _prune  # imports deepspeed: only here

    for step in (1, 2, 3, 4):
        _fake_tag(tmp_path, step)
    _truncate(tmp_path / tag_for(4) / "mp_rank_00_model_states.pt")
    doomed = _prune(str(tmp_path), keep=1)
    # set aside under .partial names first (a kill mid-deletion leaves no half-deleted tag), deleted later
    assert sorted(os.listdir(tmp_path)) == [f".{tag_for(1)}.deleted.partial", f".{tag_for(2)}.deleted.partial",
                                            tag_for(3), tag_for(4)]  # the damaged step 4 does not count
    assert sorted(os.path.basename(d) for d in doomed) == sorted(os.listdir(tmp_path))[:2]


@pytest.mark.unit
def test_verify_command_prints_a_table_and_fails_on_a_damaged_newest(tmp_path, capsys):
    _fake_tag(tmp_path, 1, recorded=False)  # written before checkpoints recorded their files
    _fake_tag(tmp_path, 2)
    assert cli(["checkpoint", "verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["tag", "files", "bytes", "status"]
    assert out[1].split()[:4] == [tag_for(1), "0", "0", "OK"] and "no sizes or checksums" in out[1]
    assert out[2].split() == [tag_for(2), "2", str(256 * 40 + 30), "OK"]
    _truncate(tmp_path / tag_for(2) / "mp_rank_00_model_states.pt")
    assert cli(["checkpoint", "verify", str(tmp_path)]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(tag_for(2)) and "DAMAGED: mp_rank_00_model_states.pt (5120 bytes, 10240 written)" in last
    assert cli(["checkpoint", "verify", str(tmp_path / "nowhere")]) == 2  # a UserError: one line, status 2


# ----------------------------------------------------------------------------------------------- universal conversion
@pytest.mark.unit
def test_waiting_for_rank_0s_conversion_is_bounded_by_its_progress_not_a_timeout(tmp_path, monkeypatch):
    from deepseek_ds.checkpoint import universal
    from deepseek_ds.checkpoint.format import UNIVERSAL_DONE
    from deepseek_ds.checkpoint.universal import CONVERTER_SILENT_S, CONVERTING_HEARTBEAT_S, wait_for_conversion

    out, status = tmp_path / "step00000002.universal-sequential", tmp_path / ".status"
    status.write_text(json.dumps({"state": "converting"}))
    converting_s = 10 * CONVERTER_SILENT_S  # far longer than the silence that ends the wait
    beats = []

    def rank0(now: float) -> None:  # renews its status every heartbeat while converting, then publishes
        if now < converting_s:
            if now >= CONVERTING_HEARTBEAT_S * (len(beats) + 1):
                beats.append(now)
                os.utime(status, ns=(len(beats) * 10**9,) * 2)  # a new mtime each beat, a second apart
        elif not out.exists():
            out.mkdir()
            (out / UNIVERSAL_DONE).write_text("{}")
            status.unlink()

    clock = _Clock(rank0)
    monkeypatch.setattr(universal, "time", clock)
    wait_for_conversion(str(out), str(status))  # the production silence bound and poll interval
    assert (out / UNIVERSAL_DONE).exists() and converting_s <= clock.now <= converting_s + 1.0
    assert len(beats) == int(converting_s // CONVERTING_HEARTBEAT_S) - 1

    status.write_text(json.dumps({"state": "converting"}))
    (out / UNIVERSAL_DONE).unlink()
    clock = _Clock()  # rank 0 died: nobody renews the file
    monkeypatch.setattr(universal, "time", clock)
    with pytest.raises(CheckpointError, match=f"rank 0 stopped converting .* not been renewed for "
                                              f"{CONVERTER_SILENT_S:.0f} s"):
        wait_for_conversion(str(out), str(status))
    assert CONVERTER_SILENT_S < clock.now <= CONVERTER_SILENT_S + 1.0  # given up one poll after the bound
    status.write_text(json.dumps({"state": "failed", "error": "boom: no optimizer shards"}))
    clock = _Clock()
    monkeypatch.setattr(universal, "time", clock)
    with pytest.raises(CheckpointError, match="rank 0 could not convert .*: boom: no optimizer shards"):
        wait_for_conversion(str(out), str(status))
    assert clock.now == 0.0  # at once, not after a silence


# ----------------------------------------------------------------------------------------------- through the launcher
def _launch(out: Path, data_dir: str, steps: int, check: bool = True) -> subprocess.CompletedProcess:
    """The straight run's settings (conftest.py `straight`, dropout on), saving every step."""
    args = ["train.py", "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}"]
    for s in resuming_sets(data_dir, steps, 1):
        args += ["--set", s]
    return run_ranks(2, args, check=check)


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


@pytest.mark.launch
def test_damaged_newest_falls_back_and_a_second_job_is_refused(tmp_path, data_dir, straight):
    # The reference: the session's straight run (its schedule does not depend on train.steps), not a launch of its own.
    straight = {step: loss for step, loss in losses(straight).items() if step <= 5}
    assert sorted(straight) == [1, 2, 3, 4, 5]
    out = tmp_path / "run"
    _launch(out, data_dir, 3)
    ckpt = out / "checkpoints"
    # One byte flipped in the middle of a file's tensor data: the sizes hold, so resume chooses the tag and its load
    # (torch.load reads the flipped weight without complaint) finds the checksum wrong as it reads (verified_load.py).
    damaged = sorted((ckpt / tag_for(3)).glob("*optim_states.pt"))[0]
    _flip_middle_byte(damaged)
    assert cli(["checkpoint", "verify", str(ckpt)]) == 1

    # A second job while a live process (this one) holds the lock: refused at start (before any engine is built),
    # with one line per host naming the holder; nothing under checkpoint.dir changes.
    lock = _write_lock(ckpt, socket.gethostname(), os.getpid())
    before = _tree(ckpt)
    refused = _launch(out, data_dir, 5, check=False)
    assert refused.returncode != 0
    errors = [line for line in (refused.stdout + refused.stderr).splitlines() if "deepseek-ds: error:" in line]
    assert errors and all(f"pid {os.getpid()}" in line and "in use by another job" in line for line in errors)
    # Every rank refused before building an engine: no rank got as far as its process groups (logged by a run that
    # starts, as the resumed one below shows).
    engine_built = "process groups, each with a"
    assert engine_built not in refused.stdout + refused.stderr
    assert _tree(ckpt) == before
    lock.unlink()

    resumed = _launch(out, data_dir, 5)
    log = resumed.stdout + resumed.stderr
    assert engine_built in log
    assert f"{tag_for(3)} is damaged: {damaged.name} (checksum differs from the one written)" in log
    assert f"resumed from {tag_for(2)} at step 2" in log
    assert losses(read_metrics(str(out))) == straight  # bitwise, every step 1-5 (dropout: the RNG too)
    assert cli(["checkpoint", "verify", str(ckpt)]) == 0  # step 3 saved again, intact
    assert not (ckpt / LOCK).exists()  # released at the end


@pytest.mark.unit
def test_list_and_verify_of_a_missing_directory_are_one_line_errors(tmp_path, capsys):
    for command in ("list", "verify"):
        assert cli(["checkpoint", command, str(tmp_path / "nope")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"deepseek-ds: error: {tmp_path / 'nope'} is not a directory") and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert cli(["checkpoint", "list", str(tmp_path / "empty")]) == 0
    assert "no complete checkpoints" in capsys.readouterr().out


@pytest.mark.launch
def test_a_background_save_that_cannot_write_fails_the_job_in_one_line_and_publishes_nothing(tmp_path, data_dir):
    """checkpoint.async with files over the disk's limit (ulimit -f: every write past 1 MiB fails, as on a full
    disk): the writer threads fail at step 2's save, every rank stops at the next step with one line, and the tag is
    never published."""
    out = tmp_path / "run"
    args = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
            "--config", "recipes/tiny-v3.yaml", "--set", f"train.output_dir={out}"]
    for s in resuming_sets(data_dir, 6, 2) + ["checkpoint.async=true"]:
        args += ["--set", s]
    # The ranks' files of the run (logs, metrics) stay far below the limit; a checkpoint's optimizer file does not.
    job = subprocess.run(["bash", "-c", 'ulimit -f 1024 && exec "$@"', "bash", *args], cwd=ROOT, env=launch_env(),
                         capture_output=True, text=True, timeout=600)
    output = job.stdout + job.stderr
    assert job.returncode == 2, output[-4000:]
    errors = [line for line in output.splitlines() if "deepseek-ds: error:" in line]
    assert errors and all(f"the checkpoint {out / 'checkpoints' / tag_for(2)} was not published: rank " in line
                          and "File too large" in line for line in errors), output[-4000:]
    assert "Traceback" not in output
    assert complete_tags(str(out / "checkpoints")) == [] and not (out / "checkpoints" / "latest").exists()
    steps = [r["step"] for r in read_metrics(str(out))]
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) < 6, steps  # stopped soon after step 2


@pytest.mark.unit
def test_a_host_copy_saves_the_same_bytes_and_does_not_follow_the_original(tmp_path):
    """async_save.host_copy of a state like DeepSpeed's (views into one flat buffer, a Parameter, settings in dicts):
    torch.save writes the very bytes of the original, and changing the original afterwards changes nothing."""
    import io
    from collections import OrderedDict

    import torch

    from deepseek_ds.checkpoint.async_save import host_copy

    flat = torch.arange(24, dtype=torch.float32)
    state = {"module": OrderedDict(w=flat[:12].view(3, 4), b=flat[12:16], t=flat[16:24].view(4, 2).t()),
             "optimizer": {"state": {0: {"exp_avg": torch.ones(5, dtype=torch.bfloat16), "step": 3}},
                           "param_groups": [{"lr": 0.1, "params": [0]}]},
             "master": torch.nn.Parameter(torch.randn(6)), "args": ("tiny", 2), "shared": [flat, flat[2:4]]}

    def saved(obj) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    before = saved(state)
    copied = host_copy(state)
    assert saved(copied) == before
    flat.add_(1)
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    state["optimizer"]["state"][0]["exp_avg"].zero_()
    assert saved(copied) == before and saved(state) != before
    assert isinstance(copied["master"], torch.nn.Parameter) and copied["master"].requires_grad


@pytest.mark.unit
def test_checkpoint_async_is_spelled_async_in_the_yaml_and_round_trips():
    cfg = run_config_from_dict({"checkpoint": {"async": True, "interval": 5}})
    assert cfg.checkpoint.async_ is True and cfg.to_dict()["checkpoint"]["async"] is True
    assert "async_" not in cfg.to_dict()["checkpoint"]
    assert run_config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown key 'checkpoint.async_' in the run config. Did you mean 'async'"):
        run_config_from_dict({"checkpoint": {"async_": True}})


@pytest.mark.unit
def test_saved_rng_states_of_random_numpy_and_torch_round_trip(tmp_path):
    """Nothing in training draws from Python's or NumPy's RNG today, but user code (reward functions, data hooks)
    will: a resume must hand it the same draws as the run that was never stopped."""
    def draws():
        return random.random(), float(np.random.rand()), np.random.normal(), torch.rand(3).tolist()

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.normal()  # leaves a cached Gaussian, part of NumPy's state
    path = rng_path(str(tmp_path), rank=1)
    os.makedirs(os.path.dirname(path))
    torch.save(rng_state(), path)
    expected = draws()
    random.seed(7), np.random.seed(8), torch.manual_seed(9)
    assert restore_rng(str(tmp_path), rank=1)
    assert draws() == expected
    assert not restore_rng(str(tmp_path), rank=0)  # no state saved for it: left as it is, and said so
