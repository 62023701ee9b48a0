"""The independent reference: one process, the transformers model, torch.optim.AdamW, no DeepSpeed engine.

It starts from the same initial weights (our per-layer seeded init, copied into the transformers model),
reads the same global batches (the sampler with a data-parallel size of 1), and computes the loss with
transformers' own causal-LM loss function.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR

from deepseek_ds.config import RunConfig
from deepseek_ds.data import GlobalBatchSampler, PackedDataset, micro_batches
from deepseek_ds.models.hf_io import to_hf_model
from deepseek_ds.models.moe import LoadBalancer, resolve_settings, router_bias
from deepseek_ds.models.pipeline import build_model, prepare_config
from deepseek_ds.models.presets import build_model_config


def reference_model(cfg: RunConfig):
    mcfg = prepare_config(build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides),
                          cfg.model.attn_implementation, cfg.model.experts_implementation)
    return to_hf_model(build_model(mcfg, 1, cfg.train.seed).layers, mcfg), mcfg


def reference_losses(cfg: RunConfig, data_dir: str, moe_log: list | None = None) -> list[float]:
    """moe_log: if given, gets each step's aux_loss and router biases (by block name)."""
    torch.manual_seed(cfg.train.seed)
    model, mcfg = reference_model(cfg)
    model.train()
    t = cfg.train
    # The run's MoE load balancing (balance losses in backward, router bias update after each step), in one process.
    settings = resolve_settings(cfg.moe, mcfg)
    balancer = (LoadBalancer(model, settings, 1 / t.global_batch_size, t.global_batch_size, "cpu")
                if settings and settings.active else None)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    # The learning-rate schedule is an input here, not what is tested: use the same schedule class.
    sched = WarmupCosineLR(opt, total_num_steps=t.steps, warmup_num_steps=max(t.warmup_steps, 1),
                           warmup_min_ratio=1.0 / t.warmup_steps if t.warmup_steps else 1.0,
                           cos_min_ratio=t.min_lr / t.lr, warmup_type="linear")
    sched.step()
    dataset = PackedDataset(data_dir, cfg.data.seq_len)
    sampler = GlobalBatchSampler(len(dataset), t.global_batch_size, t.global_batch_size, 0, 1, t.seed, shuffle=t.shuffle)
    losses = []
    for _, batch in zip(range(t.steps), micro_batches(dataset, sampler)):
        (input_ids, labels), = batch
        logits = model(input_ids=input_ids).logits
        loss = model.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=mcfg.vocab_size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        if balancer:
            aux = balancer.after_step(skipped=False)
            if moe_log is not None:
                moe_log.append({**aux, "biases": {name: router_bias(r).clone() for name, (_, r) in balancer.blocks.items()}})
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
