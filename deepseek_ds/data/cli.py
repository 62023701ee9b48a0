"""`deepseek-ds data prepare | dump`: thin argument parsing around the data package."""

import argparse
import json
import sys

from .builtin import stdlib_files
from .errors import DataError
from .packed import PackedDataset
from .prepare import prepare_dataset
from .sampler import GlobalBatchSampler


def _prepare(args: argparse.Namespace) -> int:
    inputs = args.input or stdlib_files(args.builtin_mb)
    out = prepare_dataset(inputs, args.out, tokenizer_dir=args.tokenizer, vocab_size=args.vocab_size,
                          workers=args.workers, jsonl_field=args.jsonl_field, valid_fraction=args.valid_fraction,
                          seed=args.seed, shard_mb=args.shard_mb, progress=not args.no_progress)
    print(f"prepared {out}")
    return 0


def _dump(args: argparse.Namespace) -> int:
    ds = PackedDataset(args.data, args.seq_len, args.split)
    # The training order itself (a one-sample global batch on one rank), so dumps match what is trained on.
    order = GlobalBatchSampler(len(ds), 1, 1, 0, 1, args.seed, shuffle=args.shuffle).positions(args.start, args.count)
    for i in order:
        print(json.dumps(ds[int(i)].tolist()))
    return 0


def _reporting_errors(func):
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


def register(subparsers) -> None:
    """Add `prepare` and `dump` to the `deepseek-ds data` sub-command group."""
    p = subparsers.add_parser("prepare", help="tokenize inputs into memory-mapped shards")
    p.add_argument("--input", nargs="+", action="extend",
                   help="text files, directories, .jsonl files or saved HF datasets (default: the built-in "
                        "corpus of Python standard-library sources)")
    p.add_argument("--out", required=True, help="dataset directory to create (or finish)")
    p.add_argument("--tokenizer", help="local HF tokenizer directory (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size when training one")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes; the output does not depend on it")
    p.add_argument("--jsonl-field", default="text", help="field holding the text in .jsonl / HF datasets")
    p.add_argument("--valid-fraction", type=float, default=0.01, help="fraction of documents held out")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation split")
    p.add_argument("--shard-mb", type=float, default=16.0, help="text per shard (MB)")
    p.add_argument("--builtin-mb", type=float, default=8.0, help="size of the built-in corpus (MB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_reporting_errors(_prepare))

    d = subparsers.add_parser("dump", help="print samples as JSON lists of token ids, in training order")
    d.add_argument("--data", required=True, help="prepared dataset directory")
    d.add_argument("--seq-len", type=int, required=True)
    d.add_argument("--start", type=int, default=0, help="first global sample position")
    d.add_argument("--count", type=int, default=1)
    d.add_argument("--split", default="train", choices=["train", "valid"])
    d.add_argument("--shuffle", action="store_true", help="the shuffled order of --seed (epoch 0 onwards)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_reporting_errors(_dump))
