"""`deepseek-ds generate`: text from a Hugging Face directory or a training checkpoint, greedy or top-p
sampled, through transformers' own generate()."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def load_tokenizer_from(path: str):
    """A prepared dataset's tokenizer (checked against the dataset) or a plain tokenizer directory."""
    from transformers import AutoTokenizer

    from .data import load_tokenizer
    from .data.layout import META

    if os.path.isfile(os.path.join(path, META)):
        return load_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def load_model(model: str, tokenizer: str | None = None, config: str | None = None, sets: list[str] | None = None):
    """(transformers CausalLM in eval mode, tokenizer) from an HF directory or a training checkpoint, whose
    tokenizer is the one of the dataset it was trained on."""
    if os.path.isfile(os.path.join(model, "config.json")) and not os.path.isfile(os.path.join(model, "checkpoint.json")):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), load_tokenizer_from(tokenizer or model)
    from .checkpoint import read_meta, tag_dir_of
    from .evaluation import model_from_checkpoint, run_config_for
    from .models.hf_io import to_hf_model

    tag_dir = tag_dir_of(model)
    seq_model, mcfg = model_from_checkpoint(tag_dir, run_config_for(tag_dir, config, sets or []))
    return to_hf_model(seq_model.layers, mcfg), load_tokenizer_from(tokenizer or read_meta(tag_dir)["dataset_dir"])


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt).input_ids
    if tokenizer.bos_token_id is None:
        # Tokenizers without BOS (ours) saw every document start right after an EOS in training.
        ids = [tokenizer.eos_token_id] + ids
    return torch.tensor([ids], dtype=torch.long)


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 64, top_p: float | None = None,
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory, or a training checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top-p", type=float, default=None, help="sample from the nucleus of this mass (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer or prepared dataset directory (default: the model's)")
    p.add_argument("--config", default=None, help="run YAML of a checkpoint (default: its resolved_config.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")


def _cmd_generate(args: argparse.Namespace) -> int:
    model, tok = load_model(args.model, args.tokenizer, args.config, args.set)
    if torch.cuda.is_available():
        model = model.cuda()
    ids = generate(model, tok, args.prompt, args.max_new_tokens, args.top_p, args.temperature, args.seed)
    print(args.prompt + tok.decode(ids, skip_special_tokens=True))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a model (greedy or top-p sampling)")
    add_arguments(p)
    p.set_defaults(func=_cmd_generate)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepseek_ds.generate", description=__doc__)
    add_arguments(p)
    return _cmd_generate(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
