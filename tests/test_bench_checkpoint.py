"""What makes `bench checkpoint`'s save fast without weakening integrity: DeepSpeed's files checksummed while
torch.save writes them (no re-read, torch's own zip CRC off), xxh3_64 for new records, crc32 records of older
checkpoints still verified. References: the checksum of the file's bytes read back and hashed here directly."""

import json
import zlib

import pytest
import torch
import xxhash

from deepseek_ds.bench.checkpoint_bench import format_table
from deepseek_ds.checkpoint.format import FORMAT_VERSION, META
from deepseek_ds.checkpoint.integrity import FILES, check_tag, record_files, torch_save_hashed

pytestmark = pytest.mark.unit


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"module": {"w": torch.randn(300, 70, generator=g), "b": torch.arange(7)}, "step": 3,
            "optimizer": [torch.randn(5000, generator=g).to(torch.bfloat16)]}


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
    assert record_files(str(tmp_path)) == {path.name: rec}  # the read-back record agrees


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


def test_table_ratios_are_each_rows_rate_over_its_raw_counterpart():
    rows = [{"operation": name, "GB": 0.5, "seconds": s, "GB/s": 0.5 / s}
            for name, s in [("save", 1.0), ("raw write", 0.8), ("load", 2.0), ("raw read", 0.5)]]
    ratios = [line.split()[-1] for line in format_table(rows).splitlines()[2:]]
    assert ratios == ["80%", "100%", "25%", "100%"]
