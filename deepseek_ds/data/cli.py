"""`deepseek-ds data prepare | dump`: thin argument parsing around the data package. A DataError reaches the user
through the entry point's one error report (`deepseek-ds: error: ...`, exit 2)."""

from __future__ import annotations

import argparse
import json

from ..utils.cli_args import spellings
from .builtin import stdlib_files
from .layout import dataset_info
from .packed import PackedDataset
from .prepare import prepare_dataset
from .sampler import GlobalBatchSampler
from .sources import DEFAULT_EXTENSIONS


def _extensions(value: str) -> tuple[str, ...] | None:
    if value == "all":
        return None
    return tuple(e if e.startswith(".") else f".{e}" for e in value.split(",") if e)


def summary(out: str) -> list[str]:
    """What a prepare produced, as the lines `data prepare` prints."""
    meta = dataset_info(out)
    splits = meta["splits"]
    lines = [f"prepared {out}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens, "
             f"{sum(len(s['shards']) for s in splits.values())} shards",
             "  split " + ", ".join(f"{name} {s['num_docs']:,} docs / {s['num_tokens']:,} tokens"
                                    for name, s in splits.items())]
    if splits["valid"]["num_docs"] == 0:
        lines.append("  no validation split (--valid-fraction 0, or a single document that cannot be cut at a line "
                     "boundary): keep eval.interval: 0 with this dataset")
    requested = meta.get("requested_vocab_size")
    vocab = f"  tokenizer vocabulary {meta['vocab_size']:,} tokens"
    if requested and requested != meta["vocab_size"]:
        vocab += (f" (requested {requested:,}: the corpus holds too little text to learn more merges; "
                  "pass more text or a smaller --vocab-size)")
    lines.append(vocab)
    skipped = meta.get("skipped_inputs", [])
    if skipped:
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        lines.append(f"  skipped {len(skipped)} files without a corpus extension (--extensions): {shown}")
    return lines


def _prepare(args: argparse.Namespace) -> int:
    inputs = args.input or stdlib_files(args.builtin_mb)
    out = prepare_dataset(inputs, args.out, tokenizer_dir=args.tokenizer, vocab_size=args.vocab_size,
                          workers=args.workers, jsonl_field=args.jsonl_field, valid_fraction=args.valid_fraction,
                          seed=args.seed, shard_mb=args.shard_mb, progress=not args.no_progress,
                          extensions=_extensions(args.extensions))
    print("\n".join(summary(out)))
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
                   help="fraction of documents held out; a single text file is cut at a line "
                        "boundary and its tail held out (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation split (default 0)")
    p.add_argument(*spellings("--shard-mb"), type=float, default=16.0, help="text per shard in MB (default 16)")
    p.add_argument(*spellings("--builtin-mb"), type=float, default=8.0,
                   help="size of the built-in corpus in MB (default 8)")
    p.add_argument(*spellings("--no-progress"), action="store_true", help="no progress bar")
    p.add_argument("--extensions", default=",".join(DEFAULT_EXTENSIONS),
                   help="comma-separated file extensions read from directory inputs, or 'all' (default: prose and "
                        "source code: %(default)s); the others are listed as skipped")
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
