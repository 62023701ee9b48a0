"""The tokenizer travels with the model: a dataset of another tokenizer than the base model's is refused before
launch (compared by what decides the ids, not by size); exports carry the tokenizer's special-token ids and the chat
template the data was rendered with (apply_chat_template equals the toolkit's rendering token for token, with
DeepSeek's real tokenizer); `export lora` of a full fine-tuning checkpoint is a one-line error; adapter files are
world-readable; and eval, generate and export reuse one universal conversion per version of a tag.

One launch (tests/layouts_worker.py): a full fine-tuning run from tiny-v3 with DeepSeek's vocabulary and a LoRA run
on a base model directory, both on conversations tokenized with DeepSeek's tokenizer."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deepseek_ds.checkpoint import universal
from deepseek_ds.config import load_ds_config, load_run_config, validate
from deepseek_ds.data import load_tokenizer, prepare_dataset
from deepseek_ds.data.chat import Message, encode, encode_prompt
from deepseek_ds.models.presets import build_model_config
from helpers import cli, refused, train_layouts

VOCAB = 129280  # DeepSeek's tokenizer
EOS = 1  # its <｜end▁of▁sentence｜>; tiny-v3's preset says 0 (its BOS)
CONVERSATION = [Message("system", "Answer briefly."), Message("system", "Use digits.\n"),
                Message("user", "What is 2+2?"), Message("assistant", " 4\n"), Message("user", "And 3 + 3 ?\n\n"),
                Message("assistant", "6")]


def _dicts(messages) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in messages]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, deepseek_tokenizer_dir) -> str:
    """40 two-turn conversations prepared with DeepSeek's tokenizer."""
    root = tmp_path_factory.mktemp("chat_data")
    lines = [json.dumps({"messages": _dicts([Message("user", f"What is {i} + {i}?"), Message("assistant", str(2 * i)),
                                             Message("user", "Twice that?"), Message("assistant", str(4 * i))])})
             for i in range(40)]
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return prepare_dataset([str(root / "chat.jsonl")], str(root / "data"), tokenizer_dir=deepseek_tokenizer_dir,
                           data_format="chat", valid_fraction=0.0, progress=False)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, deepseek_tokenizer_dir) -> str:
    """A base model directory: tiny-v3 with DeepSeek's vocabulary, weights, and DeepSeek's tokenizer; its config
    keeps the preset's eos_token_id 0, which an export must not copy."""
    torch.manual_seed(0)
    out = str(tmp_path_factory.mktemp("base") / "hf")
    AutoModelForCausalLM.from_config(build_model_config("tiny-v3", overrides={"vocab_size": VOCAB})).save_pretrained(out)
    AutoTokenizer.from_pretrained(deepseek_tokenizer_dir).save_pretrained(out)
    return out


def _sets(data: str, model_path: str | None = None) -> list[str]:
    source = [f"model.path={model_path}", "model.preset=null"] if model_path else [f"model.overrides.vocab_size={VOCAB}"]
    return [f"data.path={data}", *source, "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
            "eval.interval=0"]


# ----------------------------------------------------------------------------------------------- before launch
def _swapped_tokenizer(src: str, out) -> str:
    """DeepSeek's tokenizer with the ids of two ordinary tokens exchanged: same size, other ids."""
    os.makedirs(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), out / name)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "the", "and"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return str(out)


@pytest.mark.unit
def test_a_dataset_of_another_tokenizer_than_model_paths_is_refused(tmp_path, data_dir, chat_data, base_dir,
                                                                     deepseek_tokenizer_dir):
    ds = load_ds_config("ds_configs/zero1.json")
    validate(load_run_config("recipes/tiny-v3.yaml", _sets(chat_data, base_dir)), ds, 2, cuda_available=False)
    # Smaller: the built-in corpus' 2,048-token BPE on a 129,280-token base.
    msg = refused(load_run_config("recipes/tiny-v3.yaml", _sets(data_dir, base_dir)), ds, 2)
    assert f"{data_dir}/tokenizer (2,048 tokens" in msg and f"{base_dir} (129,280 tokens" in msg
    assert f"deepseek-ds data prepare --tokenizer {base_dir}" in msg
    # The same size, other ids.
    swapped = _swapped_tokenizer(deepseek_tokenizer_dir, tmp_path / "swapped")
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("the cat and the dog\n" * 50)
    other = prepare_dataset([str(text)], str(tmp_path / "other"), tokenizer_dir=swapped, valid_fraction=0.0,
                            progress=False)
    assert json.loads((tmp_path / "other" / "meta.json").read_text())["vocab_size"] == VOCAB
    msg = refused(load_run_config("recipes/tiny-v3.yaml", _sets(other, base_dir)), ds, 2)
    assert f"{other}/tokenizer (129,280 tokens" in msg and "another tokenizer" in msg
    # A preset ships no tokenizer: only ids past its embedding are refused.
    validate(load_run_config("recipes/tiny-v3.yaml", _sets(other)), ds, 2, cuda_available=False)
    refused(load_run_config("recipes/tiny-v3.yaml", _sets(other) + ["model.overrides.vocab_size=2048"]), ds, 2,
            match="was tokenized with 129280 tokens but the model's vocab_size is 2048")


@pytest.mark.unit
def test_generate_chat_renders_one_user_turn_with_the_generation_prompt(deepseek_tokenizer_dir):
    from deepseek_ds.inference.generate import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    ids = chat_prompt_ids(tok, "What is 2+2?")[0].tolist()
    # BOS <｜User｜> content <｜Assistant｜>, DeepSeek's ids written out.
    assert ids == [0, 128803] + tok("What is 2+2?", add_special_tokens=False).input_ids + [128804]


# ----------------------------------------------------------------------------------------------- after training
@pytest.fixture(scope="module")
def trained(tmp_path_factory, chat_data, base_dir) -> dict:
    """ONE launch, two runs on 2 ranks: full fine-tuning (2 steps, a checkpoint after each) and LoRA (1 step)."""
    root = tmp_path_factory.mktemp("tok_runs")
    full = _sets(chat_data) + ["train.steps=2", "checkpoint.interval=1", "checkpoint.keep=2"]
    lora = _sets(chat_data, base_dir) + ["train.steps=1", "checkpoint.interval=1", "lora.r=4", "lora.alpha=8",
                                         "moe.bias_update_speed=0"]
    dirs = train_layouts(2, root, [("full", "ds_configs/zero1.json", full), ("lora", "ds_configs/zero1.json", lora)],
                         [])
    return {name: out / "checkpoints" for name, out in dirs.items()}


def _check_chat_template(export_dir, chat_data) -> None:
    """AutoTokenizer of the export renders a multi-turn conversation as the toolkit does, token for token."""
    ours = load_tokenizer(chat_data)
    theirs = AutoTokenizer.from_pretrained(export_dir)
    whole = theirs.apply_chat_template(_dicts(CONVERSATION), tokenize=True)["input_ids"]
    assert whole == encode(ours, tuple(CONVERSATION)).ids
    prompt = theirs.apply_chat_template(_dicts(CONVERSATION[:-1]), tokenize=True, add_generation_prompt=True)
    assert prompt["input_ids"] == encode_prompt(ours, tuple(CONVERSATION[:-1]))
    assert prompt["input_ids"][-1] == 128804 and whole[-1] == EOS


@pytest.mark.launch
def test_export_hf_takes_special_tokens_and_chat_template_from_the_tokenizer(trained, chat_data, tmp_path):
    out = tmp_path / "hf"
    assert cli(["export", "hf", str(trained["full"]), "--out", str(out)]) == 0
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((out / name).read_text())
        assert (ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"]) == (0, EOS, EOS), name
    _check_chat_template(out, chat_data)
    # The merged LoRA export too, whose base directory says eos_token_id 0.
    merged = tmp_path / "merged"
    assert cli(["export", "hf", str(trained["lora"]), "--out", str(merged)]) == 0
    assert json.loads((merged / "generation_config.json").read_text())["eos_token_id"] == EOS
    _check_chat_template(merged, chat_data)


@pytest.mark.launch
def test_export_lora_is_world_readable_with_the_chat_template(trained, chat_data, tmp_path):
    out = tmp_path / "adapter"
    assert cli(["export", "lora", str(trained["lora"]), "--out", str(out)]) == 0
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "adapter_model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes
    _check_chat_template(out, chat_data)


@pytest.mark.launch
def test_export_lora_of_a_full_fine_tuning_checkpoint_says_use_export_hf(trained, base_dir, tmp_path, capsys):
    want = "is not a LoRA checkpoint (lora.r is 0): use `deepseek-ds export hf`"
    assert cli(["export", "lora", str(trained["full"]), "--out", str(tmp_path / "a")]) == 2  # from a preset
    err = capsys.readouterr().err
    assert want in err and err.count("\n") == 1 and err.startswith("deepseek-ds: error: ")
    # From a base model directory (only checkpoint.json is read before the refusal).
    tag = tmp_path / "ckpt" / "step00000002"
    tag.mkdir(parents=True)
    meta = json.loads((trained["full"] / "step00000002" / "checkpoint.json").read_text())
    meta["run_config"]["model"].update(path=base_dir, preset=None)
    (tag / "checkpoint.json").write_text(json.dumps(meta))
    assert cli(["export", "lora", str(tag), "--out", str(tmp_path / "b")]) == 2
    assert want in capsys.readouterr().err


@pytest.mark.launch
def test_eval_generate_and_export_reuse_one_conversion_per_version_of_a_tag(trained, chat_data, tmp_path,
                                                                            monkeypatch, capsys):
    conversions = []
    convert = universal.ds_to_universal.main
    monkeypatch.setattr(universal.ds_to_universal, "main", lambda args: (conversions.append(args), convert(args)))
    first = shutil.copytree(trained["full"] / "step00000001", tmp_path / "ckpt" / "step00000001")
    assert cli(["export", "hf", str(first), "--out", str(tmp_path / "a"), "--dtype", "fp32"]) == 0
    assert len(conversions) == 1
    assert cli(["generate", "--model", str(first), "--prompt", "What is 1 + 1?", "--chat",
                "--max-new-tokens", "2"]) == 0
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"prompt": "What is 1 + 1?", "response": "2"}) + "\n")
    assert cli(["eval", "--task", str(task), "--checkpoint", str(first), "--max-new-tokens", "2"]) == 0
    assert cli(["export", "hf", str(first), "--out", str(tmp_path / "b"), "--dtype", "fp32"]) == 0
    assert len(conversions) == 1  # reused three times
    capsys.readouterr()
    # The tag saved again under the same name (here: step 2's files): its conversion is stale.
    shutil.rmtree(first)
    shutil.copytree(trained["full"] / "step00000002", first)
    assert cli(["export", "hf", str(first), "--out", str(tmp_path / "c"), "--dtype", "fp32"]) == 0
    assert len(conversions) == 2
    assert cli(["export", "hf", str(trained["full"] / "step00000002"), "--out", str(tmp_path / "d"), "--dtype",
                "fp32"]) == 0
    c, d, a = (AutoModelForCausalLM.from_pretrained(tmp_path / x).state_dict() for x in "cda")
    assert all(torch.equal(c[k], d[k]) for k in d)  # step 2's weights, not the cached step 1's
    assert not all(torch.equal(a[k], d[k]) for k in d)
