"""`deepseek-ds data prepare | dump`: thin argument parsing around the data package. A DataError reaches the user
through the entry point's one error report (`deepseek-ds: error: ...`, exit 2)."""

from __future__ import annotations

import argparse
import json

from ..utils.cli_args import spellings
from .builtin import stdlib_files
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


def register(subparsers) -> None:
    """Add `prepare` and `dump` to the `deepseek-ds data` sub-command group."""
    p = subparsers.add_parser("prepare", help="tokenize inputs into memory-mapped shards")
    p.add_argument("--input", nargs="+", action="extend",
                   help="text files, directories, .jsonl files or saved HF datasets (default: the built-in "
                        "corpus of Python standard-library sources)")
    p.add_argument("--out", required=True, help="dataset directory to create (or finish)")
    p.add_argument("--tokenizer", help="local HF tokenizer directory (default: train a byte-level BPE)")
    p.add_argument(*spellings("--vocab-size"), type=int, default=2048, help="BPE vocabulary size when training one "
                   "(default 2048)")
    p.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes; the output does not depend on it (default 1)")
    p.add_argument(*spellings("--jsonl-field"), default="text",
                   help="field holding the text in .jsonl / HF datasets (default: text)")
    p.add_argument(*spellings("--valid-fraction"), type=float, default=0.01,
                   help="fraction of documents held out (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation split (default 0)")
    p.add_argument(*spellings("--shard-mb"), type=float, default=16.0, help="text per shard in MB (default 16)")
    p.add_argument(*spellings("--builtin-mb"), type=float, default=8.0,
                   help="size of the built-in corpus in MB (default 8)")
    p.add_argument(*spellings("--no-progress"), action="store_true", help="no progress bar")
    p.set_defaults(func=_prepare)

    d = subparsers.add_parser("dump", help="print samples as JSON lists of token ids, in training order")
    d.add_argument("--data", required=True, help="prepared dataset directory")
    d.add_argument(*spellings("--seq-len"), type=int, required=True, help="tokens per sample")
    d.add_argument("--start", type=int, default=0, help="first global sample position (default 0)")
    d.add_argument("--count", type=int, default=1, help="samples to print (default 1)")
    d.add_argument("--split", default="train", choices=["train", "valid"], help="which split (default: train)")
    d.add_argument("--shuffle", action="store_true", help="the shuffled order of --seed (epoch 0 onwards)")
    d.add_argument("--seed", type=int, default=0, help="seed of the shuffled order (default 0)")
    d.set_defaults(func=_dump)
