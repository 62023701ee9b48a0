"""`deepseek-ds eval`, `deepseek-ds generate` and `deepseek-ds export hf|torchscript|onnx`.

`python -m deepseek_ds.inference.cli COMMAND ...` runs the same commands without the `deepseek-ds` entry point;
a multi-rank `eval` starts its ranks that way under the deepspeed launcher.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from ..launcher.supervise import rendezvous_port
from ..utils.cli_args import add_master_port, add_num_gpus, add_run_args, positive_int, spellings
from ..utils.errors import UserError, run_command

# The commands import their modules when they run: torch, deepspeed and transformers take seconds to import, which
# every other `deepseek-ds` command (and `--help`) would otherwise pay at start-up.


# ----------------------------------------------------------------------------------------------- eval
def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", default=None,
                        help="checkpoint.dir of a run (its newest complete step) or one step directory")
    source.add_argument("--model", default=None, help="HF model directory (with --task only)")
    p.add_argument("--data", default=None,
                   help="prepared dataset directory (default: the one the checkpoint was trained on)")
    p.add_argument("--split", default="valid", help="dataset split to evaluate (default: valid)")
    add_run_args(p, config_required=False, deepspeed_config=False,
                 config_help="run YAML (default: the run config saved in the checkpoint's checkpoint.json)",
                 set_help="override, e.g. eval.batches=8, train.micro_batch_size=4, data.seq_len=256 (repeatable)")
    p.add_argument("--out", default=None, help="also write the result as JSON to this file")
    task = p.add_argument_group("task evaluation (instead of loss and perplexity)")
    task.add_argument("--task", default=None,
                      help="JSON Lines of conversations (messages, or prompt/response): greedy answers to each last "
                           "assistant turn, scored by exact match and BLEU")
    task.add_argument(*spellings("--max-new-tokens"), dest="max_new_tokens", type=positive_int, default=64,
                      metavar="N", help="tokens generated per item (default: 64)")
    task.add_argument(*spellings("--batch-size"), dest="batch_size", type=positive_int, default=8, metavar="N",
                      help="items generated together per rank (default: 8)")
    task.add_argument("--predictions", default=None,
                      help='write one {"prediction": ..., "reference": ...} line per item, in input order')
    task.add_argument("--tokenizer", default=None,
                      help="tokenizer or prepared dataset directory (default: the HF directory's own; for a "
                           "checkpoint, the one of the dataset it was trained on)")
    task.add_argument(*spellings("--skip-bad"), dest="skip_bad", action="store_true",
                      help="skip (and count) bad task lines instead of refusing the file")


_TASK_ONLY = ("model", "predictions", "tokenizer", "skip_bad")
_LOSS_ONLY = ("data",)


def _check_eval_args(args: argparse.Namespace) -> None:
    if args.task is None:
        given = [name for name in _TASK_ONLY if getattr(args, name)]
    else:
        given = [name for name in _LOSS_ONLY if getattr(args, name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UserError(f"{flags}: " + ("only with --task FILE.jsonl" if args.task is None
                                        else "only for loss evaluation, not with --task"))


def _eval_rank(args: argparse.Namespace) -> int:
    _check_eval_args(args)
    if args.task:
        from .task_eval import run_task_eval

        run_task_eval(args)
    else:
        from .eval import run_eval

        run_eval(args)
    return 0


def _forwarded_eval_args(args: argparse.Namespace) -> list[str]:
    """The eval arguments again, for the ranks the deepspeed launcher starts."""
    argv = ["--split", args.split]
    for flag in ("checkpoint", "model", "data", "config", "out", "task", "predictions", "tokenizer"):
        if getattr(args, flag):
            argv += ["--" + flag, getattr(args, flag)]
    argv += ["--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(args.batch_size)]
    argv += ["--skip-bad"] if args.skip_bad else []
    for s in args.set:
        argv += ["--set", s]
    return argv


def _cmd_eval(args: argparse.Namespace) -> int:
    """In this process, or with --num_gpus > 1 under the deepspeed launcher, each rank running _eval_rank."""
    if not args.num_gpus or args.num_gpus == 1:
        return _eval_rank(args)
    _check_eval_args(args)
    from ..utils.system import deepspeed_executable

    launcher = deepspeed_executable()
    argv = [launcher, "--num_gpus", str(args.num_gpus), "--master_port", str(rendezvous_port(args.master_port)),
            "--module", "deepseek_ds.inference.cli", "eval"]
    os.execv(launcher, argv + _forwarded_eval_args(args))
    return 0  # not reached


# ----------------------------------------------------------------------------------------------- generate
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="HF model directory, or a training checkpoint (checkpoint.dir or one step directory)")
    p.add_argument("--prompt", required=True, help="text to continue (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user turn of a conversation, rendered as the chat training data was "
                        "(the tokenizer's chat template, else DeepSeek-V3's format), and print only the answer")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--top-p", type=float, default=None, help="sample from the nucleus of this mass (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, with --top-p (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling, with --top-p (default: 0)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer or prepared dataset directory (default: the HF directory's own tokenizer; for a "
                        "checkpoint, the one of the dataset it was trained on)")
    add_run_args(p, config_required=False, deepspeed_config=False,
                 config_help="run YAML of a checkpoint (default: the run config saved in its checkpoint.json)",
                 set_help="override a value of that run config, e.g. model.attn_implementation=eager (repeatable)")


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .generate import generate, load_model

    model, tok = load_model(args.model, args.tokenizer, args.config, args.set)
    if torch.cuda.is_available():
        model = model.cuda()
    ids = generate(model, tok, args.prompt, args.max_new_tokens, args.top_p, args.temperature, args.seed, args.chat)
    print(("" if args.chat else args.prompt) + tok.decode(ids, skip_special_tokens=True))
    return 0


# ----------------------------------------------------------------------------------------------- export
def _cmd_export_hf(args: argparse.Namespace) -> int:
    from .export import export_hf

    out = export_hf(args.checkpoint, args.out, args.dtype, args.data, args.max_shard_size, args.work_dir)
    print(f"wrote {out} ({args.dtype}): load it with AutoModelForCausalLM.from_pretrained({out!r})")
    return 0


def _cmd_export_lora(args: argparse.Namespace) -> int:
    from .export_lora import export_lora

    out = export_lora(args.checkpoint, args.out, args.data)
    print(f"wrote {out}: load it with PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {out!r})")
    return 0


def _cmd_export_traced(args: argparse.Namespace) -> int:
    from .export import CHECK_SHAPES, export_onnx, export_torchscript, model_for_tracing

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        model = model_for_tracing(args.source, tmp)
    export = export_torchscript if args.format == "torchscript" else export_onnx
    worst = export(model, args.out, args.atol)
    shapes = ", ".join(str(s) for s in CHECK_SHAPES)
    print(f"wrote {args.out}: logits match PyTorch within {worst:.1e} (atol {args.atol:.0e}) on inputs {shapes}")
    return 0


def _register_export(subparsers) -> None:
    export = subparsers.add_parser("export", help="a checkpoint as an HF directory, TorchScript or ONNX")
    export = export.add_subparsers(dest="export_command", metavar="FORMAT", required=True)
    p = export.add_parser("hf", help="HF directory: config, sharded safetensors, tokenizer")
    p.add_argument("checkpoint", help="checkpoint.dir of a run (its newest complete step) or one step directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="dtype of the written weights (default: bf16; fp32 gives exactly the training model's logits)")
    p.add_argument("--data", default=None, help="prepared dataset with the tokenizer (default: the training data)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB (default: 5GB)")
    p.add_argument("--work-dir", default=None, help="where the universal conversion goes when the checkpoint directory is read-only "
                        "(default: /tmp; otherwise it is kept beside the step, for the next call)")
    p.set_defaults(func=_cmd_export_hf)
    p = export.add_parser("lora", help="peft adapter directory of a LoRA checkpoint (export hf writes it merged)")
    p.add_argument("checkpoint", help="checkpoint.dir of a LoRA run (its newest complete step) or one step directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--data", default=None, help="prepared dataset with the tokenizer (default: the training data)")
    p.set_defaults(func=_cmd_export_lora)
    for fmt, help_text in (("torchscript", "traced TorchScript module: input_ids -> logits"),
                           ("onnx", "ONNX graph with dynamic batch and sequence axes: input_ids -> logits")):
        p = export.add_parser(fmt, help=help_text)
        p.add_argument("source", help="a checkpoint (directory or step directory) or an HF model directory")
        suffix = "pt" if fmt == "torchscript" else "onnx"
        p.add_argument("--out", required=True, help=f"output file, e.g. model.{suffix}")
        p.add_argument("--atol", type=float, default=1e-4,
                       help="largest accepted |logits - PyTorch logits| (default: 1e-4)")
        p.add_argument("--work-dir", default=None, help="where the universal conversion goes when the checkpoint directory is "
                            "read-only (default: /tmp; otherwise it is kept beside the step, for the next call)")
        p.set_defaults(func=_cmd_export_traced, format=fmt)


# ----------------------------------------------------------------------------------------------- registration
def register(subparsers) -> None:
    """Add `eval`, `generate` and `export` (hf, torchscript, onnx) to the `deepseek-ds` sub-commands."""
    p = subparsers.add_parser("eval", help="validation loss, perplexity and accuracy of a checkpoint, or a task's "
                                          "exact match and BLEU (--task)")
    add_eval_arguments(p)
    add_num_gpus(p, help="ranks to evaluate on (default: 1, in this process; > 1 starts the deepspeed launcher)")
    add_master_port(p, help="with --num_gpus > 1: the ranks' rendezvous port (default: a free one)")
    p.set_defaults(func=_cmd_eval)
    p = subparsers.add_parser("generate", help="generate text from a model (greedy or top-p sampling)")
    add_generate_arguments(p)
    p.set_defaults(func=_cmd_generate)
    _register_export(subparsers)


def main(argv: list[str] | None = None) -> int:
    """`python -m deepseek_ds.inference.cli COMMAND ...`; under the deepspeed launcher, one eval rank."""
    parser = argparse.ArgumentParser(prog="python -m deepseek_ds.inference.cli", description=__doc__)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the launcher
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser("eval", help="evaluate a checkpoint in this process (one rank of a launched evaluation)")
    add_eval_arguments(p)
    p.set_defaults(func=_eval_rank)
    p = sub.add_parser("generate", help="generate text from a model")
    add_generate_arguments(p)
    p.set_defaults(func=_cmd_generate)
    _register_export(sub)
    args = parser.parse_args(argv)
    return run_command(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
