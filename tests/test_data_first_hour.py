"""What a new user meets first in `data prepare`: one text file as the corpus, stray files in a directory, and a
report that says what was built; a validation split too small for evaluation is refused before launch."""

import numpy as np
import pytest

from deepseek_ds.config import ConfigError, load_ds_config, load_run_config, validate
from deepseek_ds.data import PackedDataset, dataset_info, load_tokenizer, prepare_dataset
from helpers import cli

pytestmark = pytest.mark.unit


def _one_file(tmp_path, lines: int = 300):
    rng = np.random.default_rng(0)
    words = ["def", "return", "value", "class", "import", "λ", "数据"]
    text = "\n".join(" ".join(rng.choice(words, size=8)) for _ in range(lines)) + "\n"
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path, text


def _tokens(out: str, split: str) -> list[int]:
    ds = PackedDataset(out, 1, split)
    return [int(ds[i][0]) for i in range(len(ds))] + [int(ds[len(ds) - 1][1])]


def test_one_text_file_holds_out_its_tail_at_a_line_boundary(tmp_path):
    path, text = _one_file(tmp_path)
    out = prepare_dataset([str(path)], str(tmp_path / "out"), vocab_size=300, valid_fraction=0.1, progress=False)
    splits = dataset_info(out)["splits"]
    assert splits["train"]["num_docs"] == 1 and splits["valid"]["num_docs"] == 1
    # Each split is exactly its side of the cut, tokenized on its own, EOS after it.
    data = text.encode()
    cut = data.rfind(b"\n", 0, round(len(data) * 0.9)) + 1
    tok = load_tokenizer(out)
    for split, part in (("train", data[:cut]), ("valid", data[cut:])):
        assert _tokens(out, split) == tok.encode(part.decode(), add_special_tokens=False) + [tok.eos_token_id]
    assert 0.05 < splits["valid"]["num_tokens"] / (splits["train"]["num_tokens"] + splits["valid"]["num_tokens"]) < 0.15


def test_one_unsplittable_document_says_it_has_no_validation_split(tmp_path, capsys):
    (tmp_path / "one.jsonl").write_text('{"text": "only one record here, one line"}\n')
    assert cli(["data", "prepare", "--input", str(tmp_path / "one.jsonl"), "--out", str(tmp_path / "out"),
                "--vocab-size", "300", "--valid-fraction", "0.5", "--no-progress"]) == 0
    assert dataset_info(str(tmp_path / "out"))["splits"]["valid"]["num_docs"] == 0
    assert "no validation split" in capsys.readouterr().out


def test_directory_takes_known_extensions_and_the_report_says_what_it_did(tmp_path, capsys):
    path, _ = _one_file(tmp_path)
    (tmp_path / "in" / "more.md").write_text("# notes\n" + "value class return\n" * 50)
    (tmp_path / "in" / "stray.csv").write_text("a,b\n1,2\n")
    out = tmp_path / "out"
    assert cli(["data", "prepare", "--input", str(tmp_path / "in"), "--out", str(out), "--vocab-size", "2048",
                "--valid-fraction", "0.3", "--no-progress"]) == 0
    report = capsys.readouterr().out
    meta = dataset_info(str(out))
    assert meta["num_docs"] == 2  # corpus.txt and more.md, not stray.csv
    assert meta["skipped_inputs"] == [str(tmp_path / "in" / "stray.csv")]
    assert f"{meta['num_docs']} documents, {meta['num_tokens']:,} tokens" in report
    assert "skipped 1 files" in report and "stray.csv" in report
    assert f"tokenizer vocabulary {meta['vocab_size']:,} tokens (requested 2,048" in report
    assert meta["vocab_size"] < 2048
    # --extensions all reads the csv as text too.
    assert cli(["data", "prepare", "--input", str(tmp_path / "in"), "--out", str(tmp_path / "all"),
                "--vocab-size", "300", "--extensions", "all", "--no-progress"]) == 0
    assert dataset_info(str(tmp_path / "all"))["num_docs"] == 3


def test_validate_refuses_a_validation_split_too_small_to_evaluate(tmp_path):
    path, _ = _one_file(tmp_path, lines=40)
    out = prepare_dataset([str(path)], str(tmp_path / "out"), vocab_size=300, valid_fraction=0.02, progress=False)
    valid_tokens = dataset_info(out)["splits"]["valid"]["num_tokens"]
    cfg = load_run_config("recipes/tiny-v3.yaml", [f"data.path={out}", "eval.interval=5",
                                                   f"data.seq_len={valid_tokens}"])
    ds = load_ds_config(cfg.deepspeed_config)
    with pytest.raises(ConfigError, match=r"eval\.interval is 5 but the validation split .* eval\.interval: 0"):
        validate(cfg, ds, 2)
    cfg.eval.interval = 0
    validate(cfg, ds, 2)  # without evaluation the same dataset is fine
