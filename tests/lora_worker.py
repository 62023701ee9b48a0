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
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from deepspeed.moe.utils import is_moe_param

from deepseek_ds.bench.worker import held_bytes
from deepseek_ds.config import load_and_validate, zero_stage
from deepseek_ds.models.names import hf_name
from deepseek_ds.models.pipeline import local_layers
from deepseek_ds.parallel.expert_lora import adapter_rows, peft_tensors
from deepseek_ds.training.loop import train
from deepseek_ds.training.main import parse_args
from deepseek_ds.training.setup import build_run


def tensors(run, trainable: bool) -> dict[str, torch.Tensor]:
    """HF name -> copy of this rank's trainable (or frozen) parameters, gathered whole under ZeRO-3. Under AutoEP:
    the experts' adapters of all ranks in peft's layout; the frozen experts as transformers' fused rows of this
    rank's experts, `<name>[first:end]`; the router's weight under transformers' name."""
    params = list(run.engine.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params) if zero_stage(run.ds) == 3 else contextlib.nullcontext()
    out = {}
    with gathered:
        for layer in local_layers(run.engine.module):
            for key, p in layer.named_parameters():
                if p.requires_grad == trainable and not re.search(r"\.experts\.(lora_[AB]_|w[123]$)", key):
                    # peft's names of adapters (nested on the routed experts' two)
                    name = hf_name(layer, key).replace(".mlp.router.gate.", ".mlp.gate.")
                    out[name if trainable else re.sub(r"(\.base_layer)+\.", ".", name)] = p.detach().clone().cpu()
            for name, m in layer.named_modules():
                if isinstance(m, AutoEPMoELayer) and not trainable:
                    first = m.ep_rank * m.num_local_experts
                    rows, experts = f"[{first}:{first + m.num_local_experts}]", m.experts
                    prefix = hf_name(layer, name + ".experts")
                    out[f"{prefix}.gate_up_proj{rows}"] = torch.cat([experts.w1, experts.w3], 1).detach().clone()
                    out[f"{prefix}.down_proj{rows}"] = experts.w2.detach().clone()
    if trainable and run.cfg.parallel.expert_parallel > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, adapter_rows(local_layers(run.engine.module)))
        out.update(peft_tensors(parts))
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, int(os.environ["WORLD_SIZE"]))
    run = build_run(cfg, ds)
    initial = tensors(run, trainable=True)
    train(run)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in run.engine.module.parameters() if p.requires_grad)
    # AutoEP's expert parameters (their adapters) are ZeRO-sharded over the expert-data-parallel group only
    experts = sum(p.numel() for p in run.engine.module.parameters() if p.requires_grad and is_moe_param(p))
    result = {"initial": initial, "final": tensors(run, trainable=True), "frozen": tensors(run, trainable=False),
              "optimizer_bytes": held_bytes(run.engine)[0]["optimizer"], "trainable": trainable,
              "zero_ranks": run.layout.gradient_size,  # what ZeRO shards over: data x sequence ranks
              "expert_trainable": experts, "expert_zero_ranks": run.layout.gradient_size // cfg.parallel.expert_parallel}
    torch.save(result, os.path.join(cfg.train.output_dir, f"lora_rank{run.rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
