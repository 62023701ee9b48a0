"""`deepseek-ds generate`: text from a Hugging Face directory or a training checkpoint, greedy or top-p
sampled, through transformers' own generate(). (Batched greedy generation for task scores is
training/evaluation.py's, which training's periodic evaluation shares.)"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..checkpoint.format import META, read_meta, tag_dir_of
from ..data import DataError, load_tokenizer
from ..data.chat import USER, Message, encode_prompt
from ..data.layout import META as DATASET_META
from ..data.tokenizer import (
    backend_json,
    dataset_tokenizer_hashes,
    describe,
    directory_tokenizer,
    has_tokenizer,
    tokenizer_hash,
    vocab_size_of,
)
from ..models.hf_io import to_hf_model
from .eval import model_from_checkpoint, run_config_for
from .export_lora import ADAPTER_CONFIG, adapter_model, is_lora_checkpoint, merged_model_from_checkpoint


def load_tokenizer_from(path: str, needed_by: str):
    """A prepared dataset's tokenizer (checked against the dataset) or a plain tokenizer directory; DataError
    saying how to pass one when `path` holds neither (`needed_by` names the model that needs it)."""
    if os.path.isfile(os.path.join(path, DATASET_META)):
        return load_tokenizer(path)
    if not has_tokenizer(path):
        raise DataError(f"no tokenizer for {needed_by}: {path} is neither a prepared dataset nor a tokenizer "
                        f"directory", hint="pass --tokenizer DIR (a tokenizer directory or a prepared dataset)")
    return AutoTokenizer.from_pretrained(path)


def _same_tokenizer(tok, source: str, model: str, vocab_size: int) -> None:
    """DataError when `tok` (from --tokenizer `source`) gives other ids than the tokenizer the model directory
    ships, or, when it ships none, ids past the model's embedding: its answers would be scored as noise."""
    theirs = directory_tokenizer(model)
    found = tokenizer_hash(backend_json(tok))
    # A prepared dataset is also known by the hash its tokenizer had where it was imported from (validate's rule).
    dataset = os.path.isfile(os.path.join(source, DATASET_META))
    known = {found} | (dataset_tokenizer_hashes(source) if dataset else set())
    if theirs is not None and theirs[1] not in known:
        raise DataError(f"--tokenizer {describe(tok, source, found)} is not the tokenizer of "
                        f"{describe(theirs[0], model, theirs[1])}: the model's token ids would be read with another "
                        "vocabulary",
                        hint=f"leave out --tokenizer (the model's own is used) or pass a copy of {model}'s")
    if theirs is None and vocab_size_of(tok) > vocab_size:
        raise DataError(f"--tokenizer {describe(tok, source, found)} has more tokens than {model}'s vocab_size "
                        f"{vocab_size:,}", hint="pass the tokenizer the model was trained with")


def load_model(model: str, tokenizer: str | None = None, config: str | None = None, sets: list[str] | None = None):
    """(transformers CausalLM in eval mode, tokenizer) from an HF directory (its own tokenizer) or a training
    checkpoint (the tokenizer of the dataset it was trained on), or `tokenizer` if it decides the same ids."""
    if os.path.isfile(os.path.join(model, "config.json")) and not os.path.isfile(os.path.join(model, META)):
        tok = load_tokenizer_from(tokenizer or model, model)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        if tokenizer:
            _same_tokenizer(tok, tokenizer, model, hf.config.vocab_size)
        return hf, tok
    if os.path.isfile(os.path.join(model, ADAPTER_CONFIG)):  # `export lora`: peft's adapter on its base, merged
        tok = load_tokenizer_from(tokenizer or model, model)
        merged = adapter_model(model)
        if tokenizer:
            _same_tokenizer(tok, tokenizer, model, merged.config.vocab_size)
        return merged, tok
    tag_dir = tag_dir_of(model)
    meta = read_meta(tag_dir)
    source = tokenizer or meta["dataset_dir"]
    tok = load_tokenizer_from(source, tag_dir)
    found = tokenizer_hash(backend_json(tok))
    if found != meta["tokenizer_hash"]:
        raise DataError(f"the tokenizer of {source} (hash {found[:12]}) is not the one {tag_dir} was trained with "
                        f"(hash {meta['tokenizer_hash'][:12]})", hint="pass the tokenizer of its training data")
    if is_lora_checkpoint(tag_dir):
        hf = merged_model_from_checkpoint(tag_dir)[0]
    else:
        seq_model, mcfg = model_from_checkpoint(tag_dir, run_config_for(tag_dir, config, sets or []))
        hf = to_hf_model(seq_model.layers, mcfg)
    hf.generation_config.eos_token_id = tok.eos_token_id  # the data's EOS, not the preset's (an export writes it so)
    return hf, tok


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt).input_ids
    if tokenizer.bos_token_id is None:
        # Tokenizers without BOS (ours) saw every document start right after an EOS in training.
        ids = [tokenizer.eos_token_id] + ids
    return torch.tensor([ids], dtype=torch.long)


def chat_prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """`prompt` as one user turn and the opening of the assistant's, rendered as the training conversations were
    (data/chat.py: the tokenizer's chat_template, else DeepSeek-V3's format)."""
    return torch.tensor([encode_prompt(tokenizer, (Message(USER, prompt),))], dtype=torch.long)


def generate(model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 64, top_p: float | None = None,
             temperature: float = 1.0, seed: int = 0, chat: bool = False) -> torch.Tensor:
    """The generated token ids (prompt excluded): greedy, or nucleus sampling when top_p is given; until the
    tokenizer's EOS (not the model config's: a preset's may be another id). `chat`: the prompt is a user turn."""
    device = next(model.parameters()).device
    inputs = (chat_prompt_ids if chat else prompt_ids)(tokenizer, prompt).to(device)
    # The tokenizer's EOS and any stop ids the model's generation_config adds (an end-of-turn token); a checkpoint's
    # model has its tokenizer's (load_model: a preset's own eos may be another id).
    stops = model.generation_config.eos_token_id
    stops = [tokenizer.eos_token_id] + [i for i in (stops if isinstance(stops, list) else [stops])
                                        if i is not None and i != tokenizer.eos_token_id]
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, eos_token_id=stops,
                  use_cache=True)
    if top_p is None:
        kwargs.update(do_sample=False)
    else:
        # top_k=0: the nucleus alone decides (generate's default also keeps only the 50 best tokens).
        kwargs.update(do_sample=True, top_p=top_p, temperature=temperature, top_k=0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
    return out[0, inputs.shape[1]:]
