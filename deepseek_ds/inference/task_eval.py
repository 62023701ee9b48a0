"""`deepseek-ds eval --task FILE.jsonl`: exact match and BLEU of a model's greedy answers to held-out conversations.

Each item's last assistant turn is its reference and is not shown to the model, which answers the turns before it
(data/chat.py renders them). Generation and scoring are training/evaluation.py's (shared with eval.task during
training): one rank and any number of ranks give the same predictions and scores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.chat import fitting_items, task_items
from ..training.evaluation import predict, scores
from ..training.process import init_distributed
from ..utils.fs import write_bytes_atomic
from .generate import load_model


def _write(path: str, text: str) -> None:
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target, text.encode())


def run_task_eval(args: argparse.Namespace) -> dict:
    """Score args.checkpoint or args.model on args.task; rank 0 prints the scores as JSON and writes args.out
    (n, exact_match, bleu) and args.predictions (one {"prediction", "reference"} line per item scored). Items whose
    prompt leaves no room for an answer are refused, or with args.skip_bad skipped and counted."""
    model, tokenizer = load_model(args.checkpoint or args.model, args.tokenizer, args.config, args.set)
    items, bad = task_items(args.task, tokenizer, skip_bad=args.skip_bad)
    items, too_long = fitting_items(items, model.config.max_position_embeddings, args.task, args.skip_bad)
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if distributed:
        init_distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if torch.cuda.is_available():
        model = model.to(f"cuda:{os.environ.get('LOCAL_RANK', 0)}")
    try:
        predictions = predict(model, tokenizer, items, args.max_new_tokens, args.batch_size, rank, world)
        result = scores(predictions, [item.reference for item in items])
        if rank == 0:
            if too_long:
                print(f"skipped {too_long} items whose prompt does not fit the model's max_position_embeddings "
                      f"({model.config.max_position_embeddings})", file=sys.stderr, flush=True)
            print(json.dumps({"task": args.task, "model": args.checkpoint or args.model, "ranks": world,
                              "skipped_lines": len(bad), "skipped_long_prompts": too_long, **result}))
            if args.out:
                _write(args.out, json.dumps(result) + "\n")
            if args.predictions:
                lines = (json.dumps({"prediction": p, "reference": item.reference}) + "\n"
                         for p, item in zip(predictions, items))
                _write(args.predictions, "".join(lines))
        return result
    finally:
        if distributed:
            dist.barrier()
            dist.destroy_process_group()
