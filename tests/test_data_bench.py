"""`deepseek-ds bench data` on a tiny slice of the built-in corpus."""

import os

import pytest

from deepseek_ds.data.builtin import stdlib_files
from helpers import cli

pytestmark = pytest.mark.unit


def test_bench_table_compares_workers_with_raw_tokenizers(tmp_path, capsys):
    assert cli(["bench", "data", "--mb", "0.2", "--vocab-size", "300", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("method "):].splitlines()  # the table; DeepSpeed may log a line before it
    assert lines[0].split() == ["method", "seconds", "tokens", "tokens/s", "MB/s"]
    rows = {line.split("  ")[0].strip(): int(line.split()[-3].replace(",", "")) for line in lines[2:]}
    assert list(rows) == ["tokenizers encode_batch (raw)", "prepare, 1 worker", "prepare, 2 workers"]
    # Same text, same tokenizer: prepare adds exactly one EOS per (non-empty) document to the raw count.
    raw = rows["tokenizers encode_batch (raw)"]
    docs = sum(1 for f in stdlib_files(0.2) if os.path.getsize(f))
    assert rows["prepare, 1 worker"] == rows["prepare, 2 workers"] == raw + docs
