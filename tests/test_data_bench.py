"""`deepseek-ds bench data` on a tiny slice of the built-in corpus."""

import os

import pytest

from deepseek_ds.bench.data_bench import _median_round
from deepseek_ds.data.builtin import stdlib_files
from helpers import cli

pytestmark = pytest.mark.unit

RAW = "tokenizers encode_batch, 1 thread (raw)"
FAST = "tokenizers encode_batch_fast, 1 thread (raw)"
HEADERS = ["method", "seconds", "tokens", "tokens/s", "tokens/s/worker", "MB/s", "cores", "vs raw/worker",
           "vs fast/worker", "scaling/worker", "CPU vs fast"]


def test_bench_table_compares_workers_with_raw_tokenizers(tmp_path, capsys):
    # Two rounds: each row is then its faster one (test_a_row_is_its_median_round_with_that_rounds_cpu_time).
    assert cli(["bench", "data", "--mb", "0.2", "--vocab-size", "300", "--repeats", "2", "--work-dir",
                str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("method "):].splitlines()  # the table; DeepSpeed may log a line before it
    assert lines[0].split("  ")[0] == "method" and [h.strip() for h in lines[0].split("  ") if h] == HEADERS
    rows = {}
    for line in lines[2:6]:
        name, *cells = [c.strip() for c in line.split("  ") if c.strip()]
        rows[name] = dict(zip(HEADERS[1:], cells))
    assert list(rows) == [RAW, FAST, "prepare, 1 worker", "prepare, 2 workers"]
    raw, fast, one, two = rows.values()
    # Same text, same tokenizer: both raw calls give the same ids, and prepare adds exactly one EOS per (non-empty)
    # document to the raw count.
    tokens = {name: int(r["tokens"].replace(",", "")) for name, r in rows.items()}
    docs = sum(1 for f in stdlib_files(0.2) if os.path.getsize(f))
    assert tokens[RAW] == tokens[FAST]
    assert tokens["prepare, 1 worker"] == tokens["prepare, 2 workers"] == tokens[RAW] + docs
    # The ratio columns are the printed rates' ratios (rounding of the printed tokens/s aside).
    rate = {name: int(r["tokens/s"].replace(",", "")) for name, r in rows.items()}
    for r in (raw, fast):
        assert r["vs raw/worker"] == r["vs fast/worker"] == r["scaling/worker"] == r["CPU vs fast"] == "-"
    per_worker = {name: int(r["tokens/s/worker"].replace(",", "")) for name, r in rows.items()}
    assert per_worker[RAW] == rate[RAW] and per_worker["prepare, 1 worker"] == rate["prepare, 1 worker"]
    assert per_worker["prepare, 2 workers"] == pytest.approx(rate["prepare, 2 workers"] / 2, abs=1)
    # One thread: neither raw encoder's CPU time can exceed its wall time (tokenizers' own thread pool is off).
    assert float(raw["cores"]) <= 1.05 and float(fast["cores"]) <= 1.05
    cores = {name: float(r["cores"]) for name, r in rows.items()}
    for name in ("prepare, 1 worker", "prepare, 2 workers"):  # tokens per CPU second, over the raw fast encoder's
        assert float(rows[name]["CPU vs fast"]) == pytest.approx(
            (rate[name] / cores[name]) / (rate[FAST] / cores[FAST]), rel=0.05)
    for name, r, workers in (("prepare, 1 worker", one, 1), ("prepare, 2 workers", two, 2)):
        assert float(r["vs raw/worker"]) == pytest.approx(rate[name] / (workers * rate[RAW]), abs=0.011)
        assert float(r["vs fast/worker"]) == pytest.approx(rate[name] / (workers * rate[FAST]), abs=0.011)
    assert float(one["scaling/worker"]) == 1.0
    assert float(two["scaling/worker"]) == pytest.approx(rate["prepare, 2 workers"] / (2 * rate["prepare, 1 worker"]),
                                                         abs=0.011)
    assert "usable cores" in lines[6]
    # Round by round, 2 workers against the 1 worker of the same round, and the median of those ratios.
    by_round = lines[7].split("scaling/worker ")[1]
    ratios = [float(x) for x in by_round.split(" (median")[0].split()]
    assert lines[7].startswith("prepare, 2 workers, round by round") and len(ratios) == 2
    assert float(by_round.split("(median ")[1].split(")")[0]) == pytest.approx(sum(ratios) / 2, abs=0.006)
    assert len(by_round.split("cores ")[1].split()) == 2


def test_a_row_is_its_median_round_with_that_rounds_cpu_time():
    rounds = [{"seconds": s, "cpu_s": c} for s, c in [(5.0, 4.0), (1.0, 0.5), (3.0, 2.0), (9.0, 1.0)]]
    assert _median_round(rounds) == {"seconds": 3.0, "cpu_s": 2.0}  # lower middle of four
    assert _median_round(rounds[:3]) == {"seconds": 3.0, "cpu_s": 2.0}
    assert _median_round(rounds[1:2]) == {"seconds": 1.0, "cpu_s": 0.5}


def test_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli(["bench", "data", "--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err
