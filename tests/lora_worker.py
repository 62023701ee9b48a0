"""One rank of a LoRA run under the `deepspeed` launcher: the real set-up (build_run) and training loop (train:
resume, steps, checkpoints, metrics), then what the engine holds, which a checkpoint cannot show. Every rank writes
lora_rank<N>.pt into train.output_dir: its adapters (and other trainable tensors) before and after training and its
frozen tensors after, by HF name (frozen ones under the base's name, without peft's `.base_layer`), its optimizer
state bytes (bench/worker.held_bytes) and trainable parameter count, and its data-parallel size."""

import contextlib
import os
import re
import sys

import deepspeed
import torch
import torch.distributed as dist

from deepseek_ds.bench.worker import held_bytes
from deepseek_ds.config import load_and_validate, zero_stage
from deepseek_ds.models.names import hf_name
from deepseek_ds.models.pipeline import local_layers
from deepseek_ds.training.loop import train
from deepseek_ds.training.main import parse_args
from deepseek_ds.training.setup import build_run


def tensors(run, trainable: bool) -> dict[str, torch.Tensor]:
    """HF name -> copy of this rank's trainable (or frozen) parameters, gathered whole under ZeRO-3."""
    params = list(run.engine.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params) if zero_stage(run.ds) == 3 else contextlib.nullcontext()
    out = {}
    with gathered:
        for layer in local_layers(run.engine.module):
            for key, p in layer.named_parameters():
                if p.requires_grad == trainable:  # peft's names of adapters (nested on the routed experts' two)
                    name = hf_name(layer, key)
                    out[name if trainable else re.sub(r"(\.base_layer)+\.", ".", name)] = p.detach().clone().cpu()
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, int(os.environ["WORLD_SIZE"]))
    run = build_run(cfg, ds)
    initial = tensors(run, trainable=True)
    train(run)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in run.engine.module.parameters() if p.requires_grad)
    result = {"initial": initial, "final": tensors(run, trainable=True), "frozen": tensors(run, trainable=False),
              "optimizer_bytes": held_bytes(run.engine)[0]["optimizer"], "trainable": trainable,
              "zero_ranks": run.layout.gradient_size}  # what ZeRO shards over: data x sequence ranks
    torch.save(result, os.path.join(cfg.train.output_dir, f"lora_rank{run.rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
