"""`deepseek-ds export hf|torchscript|onnx` (the work is in export.py, imported only when a command runs)."""

from __future__ import annotations

import os
import tempfile


def _cmd_hf(args) -> int:
    from .export import export_hf

    out = export_hf(args.checkpoint, args.out, args.dtype, args.data, args.max_shard_size, args.work_dir)
    print(f"wrote {out} ({args.dtype}): load it with AutoModelForCausalLM.from_pretrained({out!r})")
    return 0


def _cmd_traced(args) -> int:
    from .export import CHECK_SHAPES, export_onnx, export_torchscript, model_for_tracing

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        model = model_for_tracing(args.source, tmp)
    export = export_torchscript if args.format == "torchscript" else export_onnx
    worst = export(model, args.out, args.atol)
    shapes = ", ".join(str(s) for s in CHECK_SHAPES)
    print(f"wrote {args.out}: logits match PyTorch within {worst:.1e} (atol {args.atol:.0e}) on inputs {shapes}")
    return 0


def register(subparsers) -> None:
    """Add `export` (hf, torchscript, onnx) to the `deepseek-ds` sub-commands."""
    export = subparsers.add_parser("export", help="a checkpoint as an HF directory, TorchScript or ONNX")
    export = export.add_subparsers(dest="export_command", metavar="FORMAT", required=True)
    p = export.add_parser("hf", help="HF directory: config, sharded safetensors, tokenizer")
    p.add_argument("checkpoint", help="checkpoint.dir of a run (its newest complete step) or one step directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--data", default=None, help="prepared dataset with the tokenizer (default: the training data)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    p.add_argument("--work-dir", default=None, help="scratch space for the universal conversion (default: /tmp)")
    p.set_defaults(func=_cmd_hf)
    for fmt, help_text in (("torchscript", "traced TorchScript module: input_ids -> logits"),
                           ("onnx", "ONNX graph with dynamic batch and sequence axes: input_ids -> logits")):
        p = export.add_parser(fmt, help=help_text)
        p.add_argument("source", help="a checkpoint (directory or step directory) or an HF model directory")
        suffix = "pt" if fmt == "torchscript" else "onnx"
        p.add_argument("--out", required=True, help=f"output file, e.g. model.{suffix}")
        p.add_argument("--atol", type=float, default=1e-4, help="largest accepted |logits - PyTorch logits|")
        p.add_argument("--work-dir", default=None, help="scratch space for the universal conversion (default: /tmp)")
        p.set_defaults(func=_cmd_traced, format=fmt)
