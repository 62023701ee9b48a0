"""What makes `bench checkpoint`'s save fast without weakening integrity: DeepSpeed's files checksummed while
torch.save writes them (no re-read, torch's own zip CRC off), xxh3_64 for new records, crc32 records of older
checkpoints still verified. References: the checksum of the file's bytes read back and hashed here directly."""

import argparse
import json
import os
import statistics
import zlib

import pytest
import torch
import xxhash

from deepseek_ds.bench import checkpoint_bench
from deepseek_ds.checkpoint.format import FORMAT_VERSION, META
from deepseek_ds.checkpoint.integrity import FILES, HashedSaves, check_tag, record_written

pytestmark = pytest.mark.unit


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"module": {"w": torch.randn(300, 70, generator=g), "b": torch.arange(7)}, "step": 3,
            "optimizer": [torch.randn(5000, generator=g).to(torch.bfloat16)]}


def torch_save_hashed(obj, path: str, **kwargs) -> dict:
    """One file saved as checkpoint saving saves DeepSpeed's files; its record."""
    saves = HashedSaves()
    saves.save(obj, path, **kwargs)
    return saves.records()[path]


@pytest.mark.parametrize("zipfile", [True, False])
def test_hashed_while_written_equals_the_files_bytes_and_loads_back(tmp_path, zipfile):
    path = tmp_path / "mp_rank_00_model_states.pt"
    rec = torch_save_hashed(_state(), str(path), _use_new_zipfile_serialization=zipfile)
    data = path.read_bytes()
    assert rec == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).intdigest()}
    back = torch.load(path, weights_only=True)
    want = _state()
    assert back["step"] == 3 and torch.equal(back["module"]["w"], want["module"]["w"])
    assert torch.equal(back["module"]["b"], want["module"]["b"])
    assert torch.equal(back["optimizer"][0], want["optimizer"][0])
    assert record_written(str(tmp_path), [str(path)]) == {path.name: rec}  # saving's read-back path agrees


def _tag(tmp_path, records: dict) -> None:
    (tmp_path / META).write_text(json.dumps({"format_version": FORMAT_VERSION, FILES: records}))


def test_a_flipped_byte_in_a_file_hashed_while_written_is_found(tmp_path):
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _tag(tmp_path, {path.name: torch_save_hashed(_state(), str(path))})
    assert check_tag(str(tmp_path)).ok
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # inside a tensor's bytes: torch.load would not notice
    path.write_bytes(bytes(data))
    assert check_tag(str(tmp_path)).problem == f"{path.name} (checksum differs from the one written)"


def test_a_checkpoint_recorded_with_crc32_still_verifies(tmp_path):
    """Checkpoints saved before xxh3_64 hold {"size", "crc32"}: verified with crc32, damage still found."""
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(_state(), path)
    data = path.read_bytes()
    _tag(tmp_path, {path.name: {"size": len(data), "crc32": zlib.crc32(data)}})
    assert check_tag(str(tmp_path)).ok
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert "checksum differs" in check_tag(str(tmp_path)).problem


def test_rows_are_the_medians_of_the_rounds_and_the_step_blocked_counts_the_updates_wait(tmp_path, monkeypatch):
    """Three rounds with known times (a fake clock) in the order the bench spends them (after an untimed step, save
    and raw write): each row is the median of its rounds; the async save's step blocked is the save's own time plus its
    next update's wait for the copy, over a synchronous save; the resume's ratio is the median of the rounds' own
    ratios, as every ratio is; the step with the save in flight is compared with the step alone."""
    durations = {"save": [9.0, 1.0, 4.0, 2.0], "blocked": [0.05, 0.1, 0.2], "durable": [1.2, 1.5, 1.1],
                 "load": [2.0, 2.0, 2.0], "write": [9.9, 0.5, 1.0, 0.8], "read": [0.25, 0.5, 0.4],
                 "step": [9.0, 3.0, 2.0, 3.5, 2.0, 3.0, 2.5], "waited": [0.05, 0.0, 0.1]}
    calls = {k: iter(v) for k, v in durations.items()}
    now = [0.0]

    def spend(kind):
        now[0] += next(calls[kind])

    class Saver:
        durable_s = None

        @property
        def update_wait_s(self):
            return next(calls["waited"])

        def wait(self):
            self.durable_s = next(calls["durable"])

    tag = tmp_path / "tag"
    tag.mkdir()
    (tag / "f.pt").write_bytes(b"x" * 1000)
    cleared = []
    monkeypatch.setattr(checkpoint_bench, "single_process_env", lambda: None)
    monkeypatch.setattr(checkpoint_bench, "load_and_validate", lambda *a, **k: (
        argparse.Namespace(checkpoint_dir=str(tmp_path / "ckpt")), None))
    monkeypatch.setattr(checkpoint_bench, "build_run", lambda cfg, ds: argparse.Namespace(saver=Saver()))
    monkeypatch.setattr(checkpoint_bench.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(checkpoint_bench.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(checkpoint_bench, "_settle", lambda: None)
    monkeypatch.setattr(checkpoint_bench, "_clear", lambda ckpt, kept, raw: cleared.append(kept))
    # Each round's async save is followed by a step (its update waiting), and its reads by a step alone.
    monkeypatch.setattr(checkpoint_bench, "training_steps", lambda run: lambda: spend("step"))
    monkeypatch.setattr(checkpoint_bench, "save", lambda run, i, c, background=False: (
        spend("blocked" if background else "save"), str(tag))[1])
    monkeypatch.setattr(checkpoint_bench, "resume", lambda run: spend("load"))
    monkeypatch.setattr(checkpoint_bench, "_raw_write", lambda blobs, d: (os.makedirs(d, exist_ok=True),
                                                                         next(calls["write"]))[1])
    monkeypatch.setattr(checkpoint_bench, "_raw_read", lambda paths: next(calls["read"]))
    rows = checkpoint_bench.run_checkpoint_bench("cfg", [], None, 3, str(tmp_path))
    assert cleared == [str(tag)] * 12  # before each of the 9 timed writes, and before each round's reads
    save, blocked, durable, write, load, read, step_saving, step = rows
    assert step_saving["seconds"] == 3.0 and step["seconds"] == 2.0 and step_saving["vs"] == 2.0 / 3.0  # medians
    assert save["seconds"] == 2.0 and write["seconds"] == 0.8 and durable["seconds"] == 1.2 and save["GB"] == 1e-6
    # The rounds' own ratios, raw over ours: 0.5/1, 1/4, 0.8/2 and 0.5/1.2, 1/1.5, 0.8/1.1.
    assert save["vs"] == 0.8 / 2.0 and durable["vs"] == pytest.approx(1.0 / 1.5)
    # The save's own time plus its update's wait: 0.1, 0.1, 0.3; over the sync save's 1, 4, 2.
    assert blocked["seconds"] == pytest.approx(0.1) and blocked["vs"] == pytest.approx(0.1 / 1.0)
    assert load["vs"] == statistics.median([0.25 / 2, 0.5 / 2, 0.4 / 2])
    assert write["vs"] is None and read["vs"] is None and step["vs"] is None
    table = checkpoint_bench.format_table(rows).splitlines()
    assert [line.split("  ")[0] for line in table[2:]] == [r["operation"] for r in rows]
    assert "0.40x raw write" in table[2] and "0.10x sync save (time)" in table[3] and "0.20x raw read" in table[6]


def test_out_writes_the_printed_table_with_where_it_was_measured(tmp_path, monkeypatch, capsys):
    rows = [{"operation": op, "GB": 0.137, "seconds": s, "GB/s": 0.137 / s, "vs": v, "against": "raw write",
             "peak_bytes": 0} for op, s, v in (("checkpoint save", 0.4, 0.57), ("a", 0.1, 0.2), ("b", 0.3, 0.6),
                                               ("raw write", 0.22, None), ("load", 0.2, 0.5), ("raw read", 0.1, None))]
    monkeypatch.setattr(checkpoint_bench, "run_checkpoint_bench", lambda *a: rows)
    v3 = {"params": 684e9, "total": 9.57e12, "weights": 1.37e12, "optimizer": 8.2e12, "fullest": 9.4e9,
          "fullest_rank": 0, "per_rank_mean": 4.67e9, "world": 2048, "layout": "pp=16"}
    monkeypatch.setattr(checkpoint_bench, "v3_checkpoint", lambda: v3)
    args = argparse.Namespace(work_dir=str(tmp_path), config="c", set=[], deepspeed_config=None, repeats=7,
                              out=str(tmp_path / "reports"), allow_busy=True)
    assert checkpoint_bench._bench(args) == 0
    text = (tmp_path / "reports" / "checkpoint.md").read_text()
    table = checkpoint_bench.format_table(rows)
    assert table in capsys.readouterr().out and table in text
    assert "then resumes and reads the raw files back, 7 rounds" in text
    assert "DeepSeek-V3 (684B parameters with its MTP module) on 2048 GPUs" in text
    assert "**git commit**" in text and "**host CPU**" in text and "**host load during the benchmark**" in text
