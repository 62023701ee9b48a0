"""`deepseek-ds generate`: text from a Hugging Face directory or a training checkpoint, greedy or top-p
sampled, through transformers' own generate()."""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..checkpoint.format import META, read_meta, tag_dir_of
from ..data import load_tokenizer
from ..data.layout import META as DATASET_META
from ..models.hf_io import to_hf_model
from .eval import model_from_checkpoint, run_config_for


def load_tokenizer_from(path: str):
    """A prepared dataset's tokenizer (checked against the dataset) or a plain tokenizer directory."""
    if os.path.isfile(os.path.join(path, DATASET_META)):
        return load_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def load_model(model: str, tokenizer: str | None = None, config: str | None = None, sets: list[str] | None = None):
    """(transformers CausalLM in eval mode, tokenizer) from an HF directory or a training checkpoint, whose
    tokenizer is the one of the dataset it was trained on."""
    if os.path.isfile(os.path.join(model, "config.json")) and not os.path.isfile(os.path.join(model, META)):
        return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), load_tokenizer_from(tokenizer or model)
    tag_dir = tag_dir_of(model)
    seq_model, mcfg = model_from_checkpoint(tag_dir, run_config_for(tag_dir, config, sets or []))
    return to_hf_model(seq_model.layers, mcfg), load_tokenizer_from(tokenizer or read_meta(tag_dir)["dataset_dir"])


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt).input_ids
    if tokenizer.bos_token_id is None:
        # Tokenizers without BOS (ours) saw every document start right after an EOS in training.
        ids = [tokenizer.eos_token_id] + ids
    return torch.tensor([ids], dtype=torch.long)


def generate(model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 64, top_p: float | None = None,
             temperature: float = 1.0, seed: int = 0) -> torch.Tensor:
    """The generated token ids (prompt excluded): greedy, or nucleus sampling when top_p is given."""
    device = next(model.parameters()).device
    inputs = prompt_ids(tokenizer, prompt).to(device)
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, use_cache=True)
    if top_p is None:
        kwargs.update(do_sample=False)
    else:
        # top_k=0: the nucleus alone decides (generate's default also keeps only the 50 best tokens).
        kwargs.update(do_sample=True, top_p=top_p, temperature=temperature, top_k=0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
    return out[0, inputs.shape[1]:]
