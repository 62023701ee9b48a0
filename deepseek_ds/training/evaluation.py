"""Validation loss, perplexity and next-token accuracy, on any number of data-parallel ranks: the periodic
evaluation of a training run, and the building blocks of `deepseek-ds eval` (inference/eval.py).

The evaluation set is the first `eval.batches x train.global_batch_size` samples of the validation split
(capped at its size), a choice that does not depend on the parallel layout. Data-parallel ranks take
contiguous shares of it; every rank runs the same number of micro-batches (short ones are padded with
ignored labels), because ZeRO-3 and pipeline forwards are collectives. Each rank sums token losses, valid
tokens and correct predictions; one all_reduce of the three sums gives exactly the token-weighted result of
a single process.

Task scores (eval.task, `deepseek-ds eval --task`): greedy answers to held-out conversations, generated in
left-padded batches with a KV cache (padding does not change a row's tokens), the items in contiguous shares per
data-parallel rank, gathered with all_gather_object; exact match and sacrebleu's corpus BLEU of the whole set.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import deepspeed
import sacrebleu
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
from torch import nn

from ..config import ConfigError
from ..data import BlendedDataset, ChatDataset, PackedDataset, load_tokenizer, micro_batch
from ..data.chat import TaskItem, fitting_items, task_items
from ..models.hf_io import to_hf_model
from ..models.loss import IGNORE_INDEX
from ..models.pipeline import split_micro_batch, to_device
from ..parallel.sequence import shard_micro_batch, whole_sequences
from ..rewards import normalize_answer
from .run import Run
from .whole_model import whole_copy


@dataclass(frozen=True)
class EvalResult:
    loss: float        # mean cross-entropy per valid token (nats)
    perplexity: float
    accuracy: float    # fraction of valid tokens whose argmax prediction is the label
    tokens: int
    task: dict = field(default_factory=dict)  # eval.task's scores (see `scores`), when the run has a task
    sources: dict = field(default_factory=dict)  # a blend's: source label -> its own EvalResult

    def as_record(self) -> dict:
        return {"eval_loss": self.loss, "eval_ppl": self.perplexity, "eval_accuracy": self.accuracy,
                "eval_tokens": self.tokens, **{f"task_{k}": v for k, v in self.task.items()},
                **{f"eval_loss/{name}": r.loss for name, r in self.sources.items()}}


class TokenSums:
    """A loss function that also keeps [summed CE, valid tokens, correct predictions] over its calls. It stands
    in for the training loss during evaluation, including inside DeepSpeed's pipeline (last stage)."""

    def __init__(self):
        self._sums: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat, labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
        ce = F.cross_entropy(flat, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        valid = labels != IGNORE_INDEX
        correct = (flat.argmax(-1) == labels) & valid
        step = torch.stack([ce.double(), valid.sum().double(), correct.sum().double()])
        self._sums = step if self._sums is None else self._sums + step
        return ce

    def sums(self, device) -> torch.Tensor:
        """The three sums on `device` (zeros where this rank computed no loss: earlier pipeline stages)."""
        return torch.zeros(3, dtype=torch.float64, device=device) if self._sums is None else self._sums.to(device)


def eval_sample_count(available: int, batches: int, global_batch_size: int) -> int:
    return min(available, batches * global_batch_size)


def rank_batches(dataset, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[tuple]:
    """This rank's micro-batches of the first `num_samples` samples (as training's: pairs, or triples with position
    ids); the same number of full-size micro-batches on every rank, padded with IGNORE_INDEX labels."""
    per_rank = math.ceil(num_samples / dp_size)
    mine = list(range(dp_rank * per_rank, min((dp_rank + 1) * per_rank, num_samples)))
    out = []
    for j in range(math.ceil(per_rank / micro_batch_size)):
        idx = mine[j * micro_batch_size:(j + 1) * micro_batch_size]
        shape = (micro_batch_size, dataset.seq_len)
        batch = [torch.zeros(shape, dtype=torch.long), torch.full(shape, IGNORE_INDEX, dtype=torch.long)]
        if getattr(dataset, "gives_position_ids", False):  # padding rows: one document each
            batch.append(torch.arange(dataset.seq_len).expand(shape).clone())
        if idx:
            for whole, part in zip(batch, micro_batch(dataset, idx)):
                whole[:len(idx)] = part
        out.append(tuple(batch))
    return out


@contextmanager
def _pipeline_eval_loss(engine, sums: TokenSums):
    """Let DeepSpeed's pipeline evaluate with `sums` as its loss, and keep it from logging its own eval loss
    (a mean of micro-batch means, not token-weighted) next to ours."""
    loss_fn, monitoring = engine.module.loss_fn, engine.monitor.enabled
    engine.module.loss_fn, engine.monitor.enabled = sums, False
    try:
        yield
    finally:
        engine.module.loss_fn, engine.monitor.enabled = loss_fn, monitoring


def pipeline_eval_chunks(engine, batches: list[tuple]) -> list[list[tuple]]:
    """The micro-batches of each eval_batch call: all at once, but DualPipeV's in chunks of its training count (its
    engine files a micro-batch's second-phase buffers by that count, whatever eval_batch is given: DeepSpeed 0.19.8),
    the last padded with ignored labels (which add nothing to the sums)."""
    if not (isinstance(engine, DualPipeVEngine) and batches):
        return [batches]
    n = engine.micro_batches
    input_ids, labels, *rest = batches[0]
    padding = (input_ids, torch.full_like(labels, IGNORE_INDEX), *rest)
    padded = batches + [padding] * (-len(batches) % n)
    return [padded[i:i + n] for i in range(0, len(padded), n)]


def evaluate(model, batches: list[tuple], device, pipeline: bool = False, counts: bool = True,
             query_mask: bool = False) -> EvalResult:
    """Evaluate `model` (a module, a DeepSpeed engine, or a PipelineEngine with pipeline=True) on this rank's
    batches and combine all ranks. Every rank must call it, with the same number of batches; `counts=False`: this
    rank's sums are another's copy (a tensor-parallel rank other than 0 sees its replica's batches) and add nothing.
    query_mask: the model's inputs carry one as in training (trainable indexers: a pipeline keeps one shape)."""
    sums = TokenSums()
    if pipeline:
        with _pipeline_eval_loss(model, sums):
            for chunk in pipeline_eval_chunks(model, batches):
                chunk = [split_micro_batch(mb, query_mask=query_mask) for mb in chunk]
                model.eval_batch(iter(chunk), compute_loss=True, bcast_loss=False, num_micro_batches=len(chunk))
    else:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            # Packed sequences: the model takes their position ids.
            for inputs, labels in (split_micro_batch(mb, query_mask=query_mask) for mb in batches):
                sums(model(to_device(inputs, device)), labels.to(device))
        model.train(was_training)
    total = sums.sums(device) if counts else torch.zeros_like(sums.sums(device))
    if dist.is_initialized():
        dist.all_reduce(total)  # pipeline: only last stages hold sums, one per replica
    ce, tokens, correct = total.tolist()
    loss = ce / tokens
    return EvalResult(loss, math.exp(loss), correct / tokens, int(tokens))


def evaluate_run(run: Run, dataset: PackedDataset | ChatDataset | BlendedDataset) -> EvalResult:
    """The periodic evaluation of a training run on its validation split, and on eval.task when it has one. A blend:
    each source's validation split on its own (eval_loss/<source>), and their means weighted as the blend weighs
    the sources (eval_loss, eval_accuracy; eval_ppl of that loss)."""
    if isinstance(dataset, BlendedDataset):
        parts = {name: _split_result(run, part) for name, part in zip(dataset.labels, dataset.datasets)}
        w = [x / sum(dataset.weights) for x in dataset.weights]
        loss = sum(wi * r.loss for wi, r in zip(w, parts.values()))
        result = EvalResult(loss, math.exp(loss), sum(wi * r.accuracy for wi, r in zip(w, parts.values())),
                            sum(r.tokens for r in parts.values()), sources=parts)
    else:
        result = _split_result(run, dataset)
    return dataclasses.replace(result, task=task_scores_run(run)) if run.cfg.eval.task else result


def _split_result(run: Run, dataset: PackedDataset | ChatDataset) -> EvalResult:
    cfg = run.cfg
    n = eval_sample_count(len(dataset), cfg.eval.batches, cfg.train.global_batch_size)
    batches = [shard_micro_batch(mb, run.layout.sequence_shard)  # sequence ranks: each its shard of the batches
               for mb in rank_batches(dataset, n, cfg.train.micro_batch_size, run.dp_rank, run.dp_size)]
    return evaluate(run.engine, batches, run.engine.device, pipeline=run.pipeline, counts=run.layout.counts_once,
                    query_mask=run.indexer is not None)


# ----------------------------------------------------------------------------------------------- task scores
def generate_batch(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int,
                   eos_token_id: int, sampling: dict | None = None, keep_eos: bool = False) -> list[list[int]]:
    """Continuations of several prompts in one batch, greedy unless `sampling`: left-padded (masked, and generate()
    counts the position ids over real tokens only, so each row is what it would be alone), with a KV cache; each cut
    before its first EOS (after it with keep_eos). sampling: generate()'s sampling arguments (temperature, top_p), drawn from torch's
    global generator."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    inputs = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(inputs)
    for row, ids in enumerate(prompts):
        inputs[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids):] = 1
    with torch.no_grad():
        out = model.generate(inputs.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=sampling is not None, **(sampling or {}), use_cache=True,
                             pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    return [row[:row.index(eos_token_id) + keep_eos] if eos_token_id in row else row for row in out[:, width:].tolist()]


def scores(predictions: list[str], references: list[str]) -> dict:
    """n; exact_match: the fraction of predictions equal to their reference once both are stripped of surrounding
    whitespace; bleu: sacrebleu's corpus BLEU (0-100, its default 13a tokenization)."""
    exact = sum(normalize_answer(p) == normalize_answer(r) for p, r in zip(predictions, references, strict=True))
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
        for ids in generate_batch(model, batch, max_new_tokens, pad, tokenizer.eos_token_id):
            answers.append(tokenizer.decode(ids, skip_special_tokens=True))
    if world == 1:
        return answers
    gathered = [None] * world
    dist.all_gather_object(gathered, answers)  # rank order = input order: the shards are contiguous
    return [answer for part in gathered for answer in part]


@lru_cache(maxsize=1)
def _run_task(path: str, dataset_dir: str, items: int, max_positions: int) -> tuple:
    """(tokenizer, items, how many were left out) of eval.task, rendered with the tokenizer of the run's dataset;
    read once per run. An item whose prompt leaves the model no room to answer is left out (a miss otherwise)."""
    tokenizer = load_tokenizer(dataset_dir)
    return (tokenizer, *fitting_items(task_items(path, tokenizer, items)[0], max_positions, path, skip_bad=True))


_TASK_BATCH = 8  # items generated together per rank during training


def task_scores_run(run: Run) -> dict:
    """eval.task's scores for the training model: every rank generates its share from a transformers view that
    shares the engine's weights (under ZeRO-3 gathered whole for the duration). Pipeline, expert- and tensor-parallel
    layouts split the model itself and cannot generate this way."""
    cfg = run.cfg
    if run.pipeline or cfg.parallel.expert_parallel > 1 or cfg.parallel.tensor_parallel > 1:
        raise ConfigError("eval.task needs the whole model on every rank: use parallel.pipeline_stages=1, "
                          "parallel.expert_parallel=1 and parallel.tensor_parallel=1, or score the checkpoints with "
                          "`deepseek-ds eval --task`")
    tokenizer, items, too_long = _run_task(cfg.eval.task, run.dataset_dir, cfg.eval.task_items,
                                           run.model_config.max_position_embeddings)
    if too_long and run.rank == 0:
        run.log.warning("eval.task: %d items of %s left out: their prompt leaves no room under max_position_embeddings "
                        "(%d)", too_long, cfg.eval.task, run.model_config.max_position_embeddings)
    with generation_model(run) as model:
        predictions = predict(model, tokenizer, items, cfg.eval.task_max_new_tokens, _TASK_BATCH, run.rank, run.world)
    return scores(predictions, [item.reference for item in items])


@contextmanager
def generation_model(run: Run):
    """A transformers model sharing the engine's weights, to generate with (under ZeRO-3 gathered whole for the
    duration; sequence-parallel attention runs whole sequences on each rank meanwhile). Under expert parallelism a
    copy with every expert (whole_model.py)."""
    module = run.engine.module
    if run.cfg.parallel.expert_parallel > 1:
        yield to_hf_model(whole_copy(run).layers, run.model_config, run.cfg.lora)
        return
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=run.engine.zero_optimization_stage() == 3):
        model = to_hf_model(module.layers, run.model_config, run.cfg.lora).to(run.engine.device)
        with whole_sequences(module):
            yield model
