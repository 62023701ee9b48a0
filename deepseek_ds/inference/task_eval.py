"""`deepseek-ds eval --task FILE.jsonl`: exact match and BLEU of a model's greedy answers to held-out conversations.

Each item's last assistant turn is its reference and is not shown to the model, which answers the turns before it
(data/chat.py renders them). The items are sharded over the data-parallel ranks in contiguous shares, generated
in batches with a KV cache (left padding does not change a row's tokens), and gathered on every rank with
all_gather_object, so one rank and any number of ranks give the same predictions and scores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import sacrebleu
import torch
import torch.distributed as dist

from ..data.chat import encode_prompt, read_conversations, split_reference
from ..training.setup import init_distributed
from ..utils.fs import write_bytes_atomic
from .generate import generate_greedy_batch, load_model


@dataclass(frozen=True)
class TaskItem:
    prompt_ids: list[int]
    reference: str


def load_task(path: str, tokenizer, items: int = 0, skip_bad: bool = False) -> tuple[list[TaskItem], list[str]]:
    """(the first `items` items of a task file, all with 0, the errors of the bad lines skipped)."""
    conversations, bad = read_conversations(path, skip_bad)
    out = []
    for messages in conversations[:items or None]:
        shown, reference = split_reference(messages)
        out.append(TaskItem(encode_prompt(tokenizer, shown), reference))
    return out, bad


def scores(predictions: list[str], references: list[str]) -> dict:
    """n; exact_match: the fraction of predictions equal to their reference once both are stripped of surrounding
    whitespace; bleu: sacrebleu's corpus BLEU (0-100, its default 13a tokenization)."""
    exact = sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True))
    return {"n": len(predictions), "exact_match": exact / len(predictions),
            "bleu": sacrebleu.corpus_bleu(predictions, [references]).score}


def shard(n: int, rank: int, world: int) -> range:
    """This rank's contiguous share of n items (the last ranks may hold fewer, or none)."""
    per_rank = math.ceil(n / world)
    return range(min(rank * per_rank, n), min((rank + 1) * per_rank, n))


def predict(model, tokenizer, items: list[TaskItem], max_new_tokens: int, batch_size: int, rank: int = 0,
            world: int = 1) -> list[str]:
    """Every item's decoded greedy answer, in input order, on every rank; rank r generates only its shard. With
    world > 1 every rank must call it (one all_gather_object)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    mine = list(shard(len(items), rank, world))
    answers = []
    for start in range(0, len(mine), batch_size):
        batch = [items[i].prompt_ids for i in mine[start:start + batch_size]]
        for ids in generate_greedy_batch(model, batch, max_new_tokens, pad, tokenizer.eos_token_id):
            answers.append(tokenizer.decode(ids, skip_special_tokens=True))
    if world == 1:
        return answers
    gathered = [None] * world
    dist.all_gather_object(gathered, answers)  # rank order = input order: the shards are contiguous
    return [answer for part in gathered for answer in part]


def _write(path: str, text: str) -> None:
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target, text.encode())


def run_task_eval(args: argparse.Namespace) -> dict:
    """Score args.checkpoint or args.model on args.task; rank 0 prints the scores as JSON and writes args.out
    (n, exact_match, bleu) and args.predictions (one {"prediction", "reference"} line per item)."""
    model, tokenizer = load_model(args.checkpoint or args.model, args.tokenizer, args.config, args.set)
    items, bad = load_task(args.task, tokenizer, skip_bad=args.skip_bad)
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
            print(json.dumps({"task": args.task, "model": args.checkpoint or args.model, "ranks": world,
                              "skipped_lines": len(bad), **result}))
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
