"""Validation loss, perplexity and next-token accuracy, on any number of data-parallel ranks.

The evaluation set is the first `eval.batches x train.global_batch_size` samples of the validation split
(capped at its size), a choice that does not depend on the parallel layout. Data-parallel ranks take
contiguous shares of it; every rank runs the same number of micro-batches (short ones are padded with
ignored labels), because ZeRO-3 and pipeline forwards are collectives. Each rank sums token losses, valid
tokens and correct predictions; one all_reduce of the three sums gives exactly the token-weighted result of
a single process.

`python -m deepseek_ds.evaluation --checkpoint DIR --data DIR` (or the same under the `deepspeed` launcher,
or `deepseek-ds eval`) evaluates a saved checkpoint without an optimizer or DeepSpeed engine: every rank
holds the whole model in fp32 and the ranks split the data.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
import tempfile
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import zero_stage
from .models.loss import IGNORE_INDEX


@dataclass(frozen=True)
class EvalResult:
    loss: float        # mean cross-entropy per valid token (nats)
    perplexity: float
    accuracy: float    # fraction of valid tokens whose argmax prediction is the label
    tokens: int

    def as_record(self) -> dict:
        return {"eval_loss": self.loss, "eval_ppl": self.perplexity, "eval_accuracy": self.accuracy,
                "eval_tokens": self.tokens}


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
    """This rank's (input_ids, labels) micro-batches of the first `num_samples` samples; the same number of
    full-size micro-batches on every rank, padded with IGNORE_INDEX labels."""
    per_rank = math.ceil(num_samples / dp_size)
    mine = list(range(dp_rank * per_rank, min((dp_rank + 1) * per_rank, num_samples)))
    out = []
    for j in range(math.ceil(per_rank / micro_batch_size)):
        idx = mine[j * micro_batch_size:(j + 1) * micro_batch_size]
        inputs = torch.zeros(micro_batch_size, dataset.seq_len, dtype=torch.long)
        labels = torch.full((micro_batch_size, dataset.seq_len), IGNORE_INDEX, dtype=torch.long)
        if idx:
            rows = torch.from_numpy(np.stack([dataset[i] for i in idx]).astype(np.int64))
            inputs[:len(idx)], labels[:len(idx)] = rows[:, :-1], rows[:, 1:]
        out.append((inputs, labels))
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


def evaluate(model, batches: list[tuple], device, pipeline: bool = False) -> EvalResult:
    """Evaluate `model` (a module, a DeepSpeed engine, or a PipelineEngine with pipeline=True) on this rank's
    batches and combine all ranks. Every rank must call it, with the same number of batches."""
    sums = TokenSums()
    if pipeline:
        with _pipeline_eval_loss(model, sums):
            model.eval_batch(iter(batches), compute_loss=True, bcast_loss=False, num_micro_batches=len(batches))
    else:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for inputs, labels in batches:
                sums(model(inputs.to(device)), labels.to(device))
        model.train(was_training)
    total = sums.sums(device)
    if dist.is_initialized():
        dist.all_reduce(total)  # pipeline: only last stages hold sums, one per replica
    ce, tokens, correct = total.tolist()
    loss = ce / tokens
    return EvalResult(loss, math.exp(loss), correct / tokens, int(tokens))


def evaluate_run(run, dataset) -> EvalResult:
    """The periodic evaluation of a training run (training.setup.Run) on its validation split."""
    cfg = run.cfg
    n = eval_sample_count(len(dataset), cfg.eval.batches, cfg.train.global_batch_size)
    batches = rank_batches(dataset, n, cfg.train.micro_batch_size, run.dp_rank, run.dp_size)
    return evaluate(run.engine, batches, run.engine.device, pipeline=run.pipeline)


# ----------------------------------------------------------------------------------------------- checkpoints
_LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt$")


def run_config_for(tag_dir: str, config: str | None, sets: list[str]):
    """The run config of a checkpoint: --config if given, else the one saved in its checkpoint.json."""
    from .checkpoint import read_meta
    from .config import apply_overrides, load_run_config, run_config_from_dict

    if config:
        return load_run_config(config, sets)
    return run_config_from_dict(apply_overrides(read_meta(tag_dir)["run_config"], sets))


def load_weights(model, tag_dir: str, config) -> None:
    """Load a DeepSpeed checkpoint's weights into a SequentialLM, whatever layout wrote it: pipeline per-layer
    files, the fp32 master weights of ZeRO 1/2/3 (consolidated by DeepSpeed's zero_to_fp32, any world size),
    the one model-states file of ZeRO-0, or the experts of an expert-parallel run."""
    from .checkpoint import read_meta, saved_layout, trusted_types_only

    if saved_layout(read_meta(tag_dir)).autoep:
        model.load_state_dict(_autoep_weights(tag_dir, config))
        return
    with trusted_types_only():
        layer_files = [f for f in glob.glob(os.path.join(tag_dir, "layer_*-model_states.pt")) if _LAYER_FILE.search(f)]
        if layer_files:
            for f in layer_files:
                idx = int(_LAYER_FILE.search(f).group(1))
                # A tied layer's later uses have no file of their own; SequentialLM.layers[i] is spec i.
                model.layers[idx].load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
            return
        states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=True)
        if zero_stage(states["ds_config"]) >= 1:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            tag_dir = os.path.normpath(tag_dir)
            # zero_to_fp32 reports progress with print(): keep stdout for the commands' own output.
            with redirect_stdout(sys.stderr):
                module = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(tag_dir), os.path.basename(tag_dir))
        else:
            module = states["module"]
    model.load_state_dict(module)


def _autoep_weights(tag_dir: str, config) -> dict[str, torch.Tensor]:
    """An expert-parallel checkpoint's weights by SequentialLM name. zero_to_fp32 takes AutoEP's per-expert files for
    model-states files and fails; the export's reader (a universal conversion) knows them and names tensors the HF
    way, which SequentialLM's names map to."""
    from .checkpoint import SEQUENTIAL
    from .checkpoint_universal import hf_state_dict_from_checkpoint, layout_names

    with tempfile.TemporaryDirectory() as tmp:
        weights = hf_state_dict_from_checkpoint(tag_dir, config, tmp)
    return {name: weights[hf] for name, hf in layout_names(config, SEQUENTIAL).items()}


def model_from_checkpoint(tag_dir: str, cfg):
    """(SequentialLM with the checkpoint's weights in fp32, its transformers config)."""
    from .models.pipeline import build_model, prepare_config
    from .models.presets import build_model_config

    mcfg = prepare_config(build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides),
                          cfg.model.attn_implementation, cfg.model.experts_implementation)
    model = build_model(mcfg, 1, cfg.train.seed)
    load_weights(model, tag_dir, mcfg)
    return model, mcfg


# ----------------------------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (uses its `latest`) or a step directory")
    p.add_argument("--data", default=None, help="prepared dataset directory (default: the one the checkpoint trained on)")
    p.add_argument("--split", default="valid")
    p.add_argument("--config", default=None, help="run YAML (default: the one saved with the checkpoint)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override, e.g. eval.batches=8, train.micro_batch_size=4, data.seq_len=256")
    p.add_argument("--out", default=None, help="also write the result as JSON to this file")


def run_eval(args: argparse.Namespace) -> EvalResult:
    from .checkpoint import read_meta, tag_dir_of
    from .data import DataError, PackedDataset, dataset_info

    tag_dir = tag_dir_of(args.checkpoint)
    cfg = run_config_for(tag_dir, args.config, args.set)
    data = args.data or read_meta(tag_dir)["dataset_dir"]
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if distributed:
        from .training.setup import init_distributed

        init_distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    try:
        model, mcfg = model_from_checkpoint(tag_dir, cfg)
        if dataset_info(data)["vocab_size"] > mcfg.vocab_size:
            raise DataError(f"{data} was tokenized with a larger vocabulary than the model's {mcfg.vocab_size}")
        dataset = PackedDataset(data, cfg.data.seq_len, split=args.split)
        n = eval_sample_count(len(dataset), cfg.eval.batches, cfg.train.global_batch_size)
        batches = rank_batches(dataset, n, cfg.train.micro_batch_size, rank, world)
        result = evaluate(model.to(device), batches, device)
        if rank == 0:
            text = json.dumps({"checkpoint": tag_dir, "data": data, "split": args.split, "samples": n, "ranks": world,
                               **result.as_record()})
            print(text)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(text + "\n")
        return result
    finally:
        if distributed:
            dist.barrier()
            dist.destroy_process_group()


def _cmd_eval(args: argparse.Namespace) -> int:
    """`deepseek-ds eval`: in this process, or under the DeepSpeed launcher with --num_gpus > 1."""
    if args.num_gpus and args.num_gpus > 1:
        launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        argv = [launcher, "--num_gpus", str(args.num_gpus), "--module", "deepseek_ds.evaluation",
                "--checkpoint", args.checkpoint, "--split", args.split]
        argv += ["--data", args.data] if args.data else []
        argv += ["--config", args.config] if args.config else []
        argv += ["--out", args.out] if args.out else []
        for s in args.set:
            argv += ["--set", s]
        os.execv(launcher, argv)
    run_eval(args)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="validation loss, perplexity and accuracy of a checkpoint")
    add_arguments(p)
    p.add_argument("--num_gpus", "--num-gpus", type=int, default=None,
                   help="ranks to evaluate on (> 1 starts the deepspeed launcher)")
    p.set_defaults(func=_cmd_eval)


def main(argv=None) -> int:
    """Entry point of one evaluation rank (`deepspeed --module deepseek_ds.evaluation ...` or plain python)."""
    p = argparse.ArgumentParser(prog="python -m deepseek_ds.evaluation", description=__doc__)
    add_arguments(p)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the launcher
    run_eval(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
