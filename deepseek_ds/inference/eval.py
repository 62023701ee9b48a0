"""`deepseek-ds eval`: validation loss, perplexity and next-token accuracy of a saved checkpoint, without an
optimizer or DeepSpeed engine. Every rank holds the whole model in fp32 and the data-parallel ranks split the
evaluation set as training's periodic evaluation does (training/evaluation.py), so one process and any number
of ranks (`deepspeed --module deepseek_ds.inference.cli eval ...`) give the same token-weighted numbers."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from ..checkpoint.format import SEQUENTIAL, read_meta, tag_dir_of
from ..checkpoint.tensor_names import layout_names
from ..checkpoint.weights import read_weights
from ..config import RunConfig, apply_overrides, load_run_config, run_config_from_dict
from ..data import DataError, PackedDataset, dataset_info
from ..data.layout import PREFERENCE_FORMAT, dataset_format
from ..models.pipeline import SequentialLM, build_model
from ..training.evaluation import EvalResult, eval_sample_count, evaluate, rank_batches
from ..training.process import init_distributed
from .export_lora import is_lora_checkpoint, merged_model_from_checkpoint
from .preference_eval import preference_eval


def run_config_for(tag_dir: str, config: str | None, sets: list[str]) -> RunConfig:
    """The run config of a checkpoint: --config if given, else the one saved in its checkpoint.json."""
    if config:
        return load_run_config(config, sets)
    return run_config_from_dict(apply_overrides(read_meta(tag_dir)["run_config"], sets))


def model_from_checkpoint(tag_dir: str, cfg: RunConfig) -> tuple[SequentialLM, PretrainedConfig]:
    """(SequentialLM with the checkpoint's fp32 weights, its transformers config), whatever layout wrote it; a LoRA
    checkpoint's adapters merged by peft into the base from its model.path."""
    mcfg = cfg.model.hf_config
    model = build_model(mcfg, 1, cfg.train.seed)
    if is_lora_checkpoint(tag_dir):  # it holds no base weights
        merged = merged_model_from_checkpoint(tag_dir, cfg.model.experts_implementation)[0].state_dict()
        model.load_state_dict({name: merged[hf] for name, hf in layout_names(mcfg, SEQUENTIAL).items()})
        return model, mcfg
    with tempfile.TemporaryDirectory() as work_dir:  # a universal conversion, when the checkpoint needs one
        model.load_state_dict(read_weights(tag_dir, mcfg, work_dir, scheme=SEQUENTIAL))
    return model, mcfg


def _check_tokenizer(data: str, meta: dict) -> None:
    """Token ids mean something only under the tokenizer the checkpoint was trained with (a resume refuses the
    same mismatch)."""
    theirs = dataset_info(data)["tokenizer_hash"]
    if theirs != meta["tokenizer_hash"]:
        raise DataError(f"{data} was tokenized with another tokenizer (hash {theirs[:12]}) than the checkpoint "
                        f"(hash {meta['tokenizer_hash'][:12]}, data {meta['dataset_dir']}): its loss would mean "
                        f"nothing; prepare it with the checkpoint's tokenizer (`deepseek-ds data prepare --tokenizer "
                        f"{os.path.join(meta['dataset_dir'], 'tokenizer')} ...`)")


def _report(record: dict, out: str | None) -> None:
    text = json.dumps(record)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def run_eval(args: argparse.Namespace) -> EvalResult | dict:
    """Evaluate args.checkpoint on args.data (default: the dataset it trained on); rank 0 prints the result as JSON
    (and writes it to args.out)."""
    tag_dir = tag_dir_of(args.checkpoint)
    cfg = run_config_for(tag_dir, args.config, args.set)
    meta = read_meta(tag_dir)
    data = args.data or meta["dataset_dir"]
    _check_tokenizer(data, meta)
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if distributed:
        init_distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    try:
        model, mcfg = model_from_checkpoint(tag_dir, cfg)
        if dataset_info(data)["vocab_size"] > mcfg.vocab_size:
            raise DataError(f"{data} was tokenized with a larger vocabulary than the model's {mcfg.vocab_size}")
        if dataset_format(dataset_info(data)) == PREFERENCE_FORMAT:  # pair metrics, in this process on every rank
            record = preference_eval(model.to(device), cfg, mcfg, data, args.split, device)
            if rank == 0:
                _report({"checkpoint": tag_dir, "data": data, "split": args.split, **record}, args.out)
            return record
        dataset = PackedDataset(data, cfg.data.seq_len, split=args.split)
        n = eval_sample_count(len(dataset), cfg.eval.batches, cfg.train.global_batch_size)
        batches = rank_batches(dataset, n, cfg.train.micro_batch_size, rank, world)
        result = evaluate(model.to(device), batches, device)
        if rank == 0:
            _report({"checkpoint": tag_dir, "data": data, "split": args.split, "samples": n, "ranks": world,
                     **result.as_record()}, args.out)
        return result
    finally:
        if distributed:
            dist.barrier()
            dist.destroy_process_group()
