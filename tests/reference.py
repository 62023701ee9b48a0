"""The independent reference: one process, the transformers model, torch.optim.AdamW, no DeepSpeed engine.

It starts from the same initial weights (our per-layer seeded init, copied into the transformers model),
reads the same global batches (the sampler with a data-parallel size of 1), and computes the loss with
transformers' own causal-LM loss function. Multi-token prediction runs on transformers' own MtpModel (the
DeepSeek-V3 MTP layers its assisted generation uses), sharing the main model's embedding and head.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR

from deepseek_ds.config import RunConfig
from deepseek_ds.data import GlobalBatchSampler, PackedDataset, micro_batches
from deepseek_ds.models.hf_io import hf_state_dict, to_hf_model
from deepseek_ds.models.layers import MTPLayerPipe
from deepseek_ds.models.moe import LoadBalancer, resolve_settings, router_bias
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config


def reference_model(cfg: RunConfig, with_mtp: bool = False):
    """(transformers CausalLM with our seeded initial weights, its config[, transformers MtpModel or None])."""
    mcfg = prepare_config(build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides),
                          cfg.model.attn_implementation, cfg.model.experts_implementation)
    layers = local_layers(build_model(mcfg, 1, cfg.train.seed))
    model = to_hf_model(layers, mcfg)
    if not with_mtp:
        return model, mcfg
    return model, mcfg, mtp_reference(model, [l for l in layers if isinstance(l, MTPLayerPipe)])


def mtp_reference(main, mtp_layers):
    """transformers' MtpModel on `main` holding the weights of our MTP layers (None without MTP layers). Our names
    are the published checkpoint's; the renaming below is the one MtpModel.from_pretrained applies to them."""
    from transformers.modeling_layers import MtpModel

    if not mtp_layers:
        return None
    keep = {k: v.clone() for k, v in main.state_dict().items()}
    mtp = MtpModel(main, len(mtp_layers))
    main.load_state_dict(keep)  # MtpModel's post_init may re-initialise the shared embedding and head
    n = main.config.num_hidden_layers
    state = {}
    for name, tensor in hf_state_dict(mtp_layers).items():
        layer, key = name.removeprefix("model.layers.").split(".", 1)
        if key.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            new = key
        elif key.startswith("shared_head.norm."):
            new = key.replace("shared_head.norm.", "post_norm.")
        else:
            new = "mtp_block." + key
        state[f"layers.{int(layer) - n}.{new}"] = tensor
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "shared_head.", "rotary_emb."))]
    assert not missing and not unexpected, (missing, unexpected)
    return mtp.train()


def mtp_logits(main, mtp, input_ids: torch.Tensor) -> tuple:
    """(main logits, MTP depth 1..D logits) under teacher forcing: depth k at position i < T - k reads token i+k and
    its previous depth's output at i (the main model's final hidden state for k = 1), as MtpModel.forward_layer does."""
    out = main(input_ids=input_ids, output_hidden_states=True)
    logits, previous = [out.logits], out.hidden_states[-1]
    t = input_ids.shape[1]
    position_ids = torch.arange(t).unsqueeze(0).expand_as(input_ids)
    for k in range(1, mtp.num_mtp_layers + 1):
        previous = mtp.forward_layer(k - 1, previous[:, :t - k], position_ids[:, :t - k], None,
                                     input_ids=input_ids[:, k:])
        logits.append(mtp._project_to_logits(previous))
    return tuple(logits)


def mtp_reference_loss(main, mtp, input_ids, labels, weight: float) -> tuple[torch.Tensor, list[float]]:
    """(L_main + weight / D * sum_k L_k, [L_main, L_1, ..., L_D]) with transformers' causal-LM loss."""
    parts = []
    for k, logits in enumerate(mtp_logits(main, mtp, input_ids)):
        parts.append(main.loss_function(logits=logits, labels=None, shift_labels=labels[:, k:].contiguous(),
                                        vocab_size=main.config.vocab_size))
    total = parts[0] + weight / (len(parts) - 1) * sum(parts[1:])
    return total, [p.item() for p in parts]


def reference_losses(cfg: RunConfig, data_dir: str, moe_log: list | None = None,
                     mtp_log: list | None = None) -> list[float]:
    """moe_log: if given, gets each step's aux_loss and router biases (by block name); mtp_log: each step's
    [L_main, L_1, ..., L_D] (MTP models)."""
    torch.manual_seed(cfg.train.seed)
    model, mcfg, mtp = reference_model(cfg, with_mtp=True)
    model.train()
    t = cfg.train
    whole = model if mtp is None else torch.nn.ModuleList([model, mtp])
    # The run's MoE load balancing (balance losses in backward, router bias update after each step), in one process.
    settings = resolve_settings(cfg.moe, mcfg)
    balancer = (LoadBalancer(whole, settings, 1 / t.global_batch_size, t.global_batch_size, "cpu")
                if settings and settings.active else None)
    params = list({id(p): p for p in whole.parameters()}.values())  # the shared embedding and head once
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
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
        if mtp is not None:
            loss, parts = mtp_reference_loss(model, mtp, input_ids, labels, t.mtp_loss_weight)
            if mtp_log is not None:
                mtp_log.append(parts)
        else:
            logits = model(input_ids=input_ids).logits
            loss = model.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=mcfg.vocab_size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        if balancer:
            aux = balancer.after_step(skipped=False)
            if moe_log is not None:
                moe_log.append({**aux, "biases": {name: router_bias(r).clone() for name, (_, r) in balancer.blocks.items()
                                                  if router_bias(r) is not None}})
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
