"""What every export (`export hf`, `export lora`) writes beside the weights, in one place: the tokenizer the model was
trained with, carrying the chat template its conversations were rendered with; the special-token ids of that
tokenizer in config.json and generation_config.json (a preset's ids are its architecture's, not the data's), with the
KV cache on; and file modes readable by all."""

from __future__ import annotations

import os

from torch import nn

from ..data import DataError, dataset_info, load_tokenizer
from ..data.tokenizer import chat_template_of


def training_tokenizer(meta: dict, data_dir: str | None = None):
    """The tokenizer a checkpoint (its metadata `meta`) was trained with: that of `data_dir`, by default the
    training data's; DataError when the directory is gone or holds another tokenizer."""
    data_dir = data_dir or meta["dataset_dir"]
    if not os.path.isdir(data_dir):
        raise DataError(f"the tokenizer comes from the training data, but {data_dir} does not exist; pass the "
                        "prepared dataset directory with --data")
    if dataset_info(data_dir)["tokenizer_hash"] != meta["tokenizer_hash"]:
        raise DataError(f"the tokenizer of {data_dir} is not the one the checkpoint was trained with "
                        f"(hash {meta['tokenizer_hash'][:12]}); pass that dataset with --data")
    return load_tokenizer(data_dir)


def special_token_ids(tok) -> dict[str, int | None]:
    """bos, eos and pad ids of a tokenizer; pad is EOS when it has none (training pads with EOS: data/sft.py)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": pad}


def set_inference_fields(model: nn.Module, tok, config_pad: bool = True) -> None:
    """Before save_pretrained: give the model's config and generation config the tokenizer's special-token ids, and
    turn the KV cache back on (training sets use_cache False: models/pipeline.py prepare_config), so that a user's
    generate() reuses its keys and values instead of recomputing every position per token. config_pad False leaves
    the config's pad_token_id as it was (generation_config.json gets the tokenizer's): transformers and our
    embedding make it the embedding's padding_idx, whose row then gets no gradient in training."""
    own_pad = model.config.pad_token_id
    for target in (model.config, getattr(model, "generation_config", None)):
        if target is not None:
            for key, value in special_token_ids(tok).items():
                setattr(target, key, value)
            target.use_cache = True
    if not config_pad:
        model.config.pad_token_id = own_pad


def save_tokenizer(tok, out: str) -> None:
    """The tokenizer into an export directory, with the chat template the training data was rendered with, so that
    AutoTokenizer.from_pretrained(out).apply_chat_template gives the training ids (a tokenizer that cannot render
    conversations gets none)."""
    template = chat_template_of(tok)
    if template is not None and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(out)


def readable_by_all(directory: str) -> None:
    """save_pretrained (transformers' and peft's) writes the weights through a private temporary file (mode 0600)
    while their siblings get the usual 0644: give every exported file the same, world-readable mode, as a shared
    model directory needs."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            os.chmod(path, 0o644)
