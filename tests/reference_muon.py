"""The independent Muon reference: one process, the transformers model, torch.optim.Muon for the hidden matrices and
torch.optim.AdamW for the rest, no DeepSpeed engine (reference.py's model, data and AdamW with its schedule).

The split is written out here from the published rule (Keller Jordan's Muon; Moonlight, arXiv:2502.16982): the 2-D
weights of the decoder layers (HF names `model.layers.N.*`) take Muon, the embedding, the output head and every
1-D parameter AdamW. torch.optim.Muon runs its Newton-Schulz iteration in bf16; `fp32_newton_schulz` swaps in the
same iteration in fp32 for exactness checks."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from unittest import mock

import torch
from torch.optim import _muon

from deepseek_ds.config import RunConfig
from reference import reference_model, reference_optimizer
from reference_data import StreamSamples, step_batch


def reference_split(model: torch.nn.Module) -> tuple[list, list]:
    """(Muon parameters, AdamW parameters) of a transformers CausalLM (no MTP)."""
    muon, adam = [], []
    for name, p in model.named_parameters():
        (muon if p.ndim == 2 and re.match(r"model\.layers\.\d+\.", name) else adam).append(p)
    return muon, adam


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim._muon._zeropower_via_newtonschulz with its bf16 cast made an fp32 one."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@contextlib.contextmanager
def fp32_newton_schulz() -> Iterator[None]:
    with mock.patch.object(_muon, "_zeropower_via_newtonschulz", _newton_schulz_fp32):
        yield


def muon_reference_run(cfg: RunConfig, data_dir: str, muon_lr: float,
                       momentum: float = 0.95) -> tuple[list[float], list[float]]:
    """Each step's loss and gradient norm (of every gradient, before clipping) of a dense model (no MoE balancing, no
    MTP) trained with Muon + AdamW, the gradients clipped to train.grad_clip (if > 0) before either optimizer sees
    them. The Muon learning rate follows the AdamW group's schedule (the same WarmupCosineLR ratio)."""
    t = cfg.train
    torch.manual_seed(t.seed)
    model, mcfg = reference_model(cfg)
    model.train()
    muon_params, adam_params = reference_split(model)
    adam, sched = reference_optimizer(adam_params, t)
    muon = torch.optim.Muon(muon_params, lr=muon_lr, weight_decay=t.weight_decay, momentum=momentum, nesterov=True,
                            adjust_lr_fn="original")
    data = StreamSamples(data_dir, cfg.data.seq_len)
    losses, norms = [], []
    for step in range(1, t.steps + 1):
        (input_ids, labels), = step_batch(data, step, t.global_batch_size, t.seed, t.shuffle)
        logits = model(input_ids=input_ids).logits
        loss = model.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=mcfg.vocab_size)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf")).item())
        muon.param_groups[0]["lr"] = muon_lr * adam.param_groups[0]["lr"] / t.lr
        adam.step()
        muon.step()
        sched.step()
        adam.zero_grad()
        muon.zero_grad()
        losses.append(loss.item())
    return losses, norms
