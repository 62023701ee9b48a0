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
from ..data.layout import META as DATASET_META
from ..data.tokenizer import backend_json, tokenizer_hash
from ..models.hf_io import to_hf_model
from .eval import model_from_checkpoint, run_config_for
from .export_lora import ADAPTER_CONFIG, adapter_model, is_lora_checkpoint, merged_model_from_checkpoint

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer_from(path: str, needed_by: str):
    """A prepared dataset's tokenizer (checked against the dataset) or a plain tokenizer directory; DataError
    saying how to pass one when `path` holds neither (`needed_by` names the model that needs it)."""
    if os.path.isfile(os.path.join(path, DATASET_META)):
        return load_tokenizer(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise DataError(f"no tokenizer for {needed_by}: {path} is neither a prepared dataset nor a tokenizer "
                        f"directory", hint="pass --tokenizer DIR (a tokenizer directory or a prepared dataset)")
    return AutoTokenizer.from_pretrained(path)


def load_model(model: str, tokenizer: str | None = None, config: str | None = None, sets: list[str] | None = None):
    """(transformers CausalLM in eval mode, tokenizer) from an HF directory (its own tokenizer) or a training
    checkpoint (the tokenizer of the dataset it was trained on, or `tokenizer` if it decides the same ids)."""
    if os.path.isfile(os.path.join(model, "config.json")) and not os.path.isfile(os.path.join(model, META)):
        tok = load_tokenizer_from(tokenizer or model, model)
        return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), tok
    if os.path.isfile(os.path.join(model, ADAPTER_CONFIG)):  # `export lora`: peft's adapter on its base, merged
        tok = load_tokenizer_from(tokenizer or model, model)
        return adapter_model(model), tok
    tag_dir = tag_dir_of(model)
    meta = read_meta(tag_dir)
    source = tokenizer or meta["dataset_dir"]
    tok = load_tokenizer_from(source, tag_dir)
    found = tokenizer_hash(backend_json(tok))
    if found != meta["tokenizer_hash"]:
        raise DataError(f"the tokenizer of {source} (hash {found[:12]}) is not the one {tag_dir} was trained with "
                        f"(hash {meta['tokenizer_hash'][:12]})", hint="pass the tokenizer of its training data")
    if is_lora_checkpoint(tag_dir):
        return merged_model_from_checkpoint(tag_dir)[0], tok
    seq_model, mcfg = model_from_checkpoint(tag_dir, run_config_for(tag_dir, config, sets or []))
    return to_hf_model(seq_model.layers, mcfg), tok


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

