"""The independent reference: one process, the transformers model, torch.optim.AdamW, no DeepSpeed engine.

It starts from the same initial weights (our per-layer seeded init, copied into the transformers model),
reads the same global batches (in its own data order, reference_data.py, as one process), and computes the loss with
transformers' own causal-LM loss function. Multi-token prediction runs on transformers' own MtpModel (the
DeepSeek-V3 MTP layers its assisted generation uses), sharing the main model's embedding and head. MoE load
balancing (router bias update, balance losses) is written here from the papers, apart from deepseek_ds.models.moe.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from deepspeed.runtime.lr_schedules import WarmupCosineLR
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter

from deepseek_ds.config import RunConfig
from deepseek_ds.models.hf_io import hf_state_dict, to_hf_model
from deepseek_ds.models.layers import MTPLayerPipe
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from reference_data import ChatSamples, StreamSamples, step_batch


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


# ----------------------------------------------------------------------------------------------- MoE load balancing
# DeepSeek-V3 (arXiv:2412.19437): sec. 2.1.2 (auxiliary-loss-free balancing: after each step, b_i += gamma where
# expert i was under-loaded, -= gamma where over-loaded), eq. 17-20 (sequence-wise balance loss); sec. 4.2 gives
# gamma = 0.001, alpha = 0.0001. DeepSeek-V2 (arXiv:2405.04434): eq. 12-14 (expert-level), 15-17 (device-level) and
# 18-20 (communication) balance losses, alpha1 = 0.003, alpha2 = 0.05, alpha3 = 0.02 (sec. 3.1.2); V2 has no bias.
# DeepSeek-V4: V3's rule and loss on its top-k layers, on sqrt(softplus) affinities; its hash layers route by a fixed
# token table, which neither moves.
# DeepSeek-V3.2 keeps V3's MoE.
PUBLISHED = {"deepseek_v3": (1e-3, 1e-4, 0.0, 0.0), "deepseek_v2": (0.0, 3e-3, 0.05, 0.02),
             "deepseek_v4": (1e-3, 1e-4, 0.0, 0.0), "deepseek_v32": (1e-3, 1e-4, 0.0, 0.0)}
ROUTERS = (DeepseekV3TopkRouter, DeepseekV2TopkRouter, DeepseekV4TopKRouter, DeepseekV32TopkRouter)
AFFINITY = {"deepseek_v3": torch.sigmoid, "deepseek_v32": torch.sigmoid, "deepseek_v2": lambda x: x.softmax(-1),
            "deepseek_v4": lambda x: F.softplus(x).sqrt()}
BIAS = "e_score_correction_bias"
# A layout sums in another order than the reference, so its routing scores differ from the reference's: up to ~5e-7
# measured (EP=2 against ZeRO-1, MTP, with the tests' Adam eps of 1e-5; several 1e-6 at eps 1e-8). A token whose
# top-k decision is closer than that can go to another expert there: a jump in the loss that no tolerance absorbs.
# Every MoE reference (reference_losses) checks that it keeps clear of such ties.
ROUTING_TIE = 2e-6


def routing_margin(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, groups: int, limit: int,
                   model_type: str) -> float:
    """The smallest gap, over the tokens of router logits (..., N), at which routing decides (transformers' V2/V3/V4
    routers): between the limit-th and the next device group (group-limited routing), and between the k-th and the
    next expert of the kept groups. Group scores are V3's sum of a group's top two (sigmoid + bias) or V2's max."""
    n = logits.shape[-1]
    s = AFFINITY[model_type](logits.detach().float().reshape(-1, n))
    s = s + (bias.float() if bias is not None else 0.0)
    gaps = []
    if limit < groups:
        per_group = s.view(-1, groups, n // groups)
        g = per_group.topk(2, -1)[0].sum(-1) if model_type != "deepseek_v2" else per_group.amax(-1)
        ranked = g.sort(-1, descending=True)[0]
        gaps.append(ranked[:, limit - 1] - ranked[:, limit])
        kept = torch.zeros_like(g).scatter_(1, g.topk(limit, -1)[1], 1.0).repeat_interleave(n // groups, 1)
        s = s.masked_fill(kept == 0, float("-inf"))
    ranked = s.sort(-1, descending=True)[0]
    gaps.append(ranked[:, top_k - 1] - ranked[:, top_k])
    return min(float(g.min()) for g in gaps)


def assert_clear_of_routing_ties(moe_log: list[dict]) -> None:
    """Fails, naming the way out, when the reference routed a token within ROUTING_TIE of a tie at some step."""
    margins = [step["routing_margin"] for step in moe_log]
    assert min(margins) > ROUTING_TIE, (
        f"the reference routes a token within {ROUTING_TIE} of a tie (smallest decision gap per step: {margins}), "
        "where the layouts' roundoff may route it differently: change this test's seed or settings")


def balance_terms(logits: torch.Tensor, experts: torch.Tensor, alphas: list[float], top_k: int, groups: int,
                  limit: int, model_type: str) -> torch.Tensor:
    """(B, 3) from router logits (B, T, N) and chosen experts (B, T, K): per sequence alpha * sum_i f_i P_i (V3
    sequence-wise = V2 expert-level), alpha2 * sum_d f'_d P'_d (device) and alpha3 * sum_d f''_d P''_d
    (communication), with f_i = N / (K T) * count_t(i chosen), P_i = mean_t s'_{i,t}, s' the affinities
    (sigmoid, softmax or sqrt-softplus) normalised over the experts, and for the D device groups f'_d = mean of their f_i,
    P'_d = P''_d = sum of their P_i, f''_d = D / (M T) * count_t(token t sent to group d), M = limit."""
    b, t, n = logits.shape
    s = AFFINITY[model_type](logits.float())
    p = (s / s.sum(-1, keepdim=True)).mean(1)
    chosen = F.one_hot(experts, n).sum(2).float()  # (B, T, N): 1 where token t chose expert i
    f = chosen.sum(1) * (n / (top_k * t))  # in eq. 18's order: MTP runs' Adam steps amplify even a last-bit change
    f_group, p_group = f.view(b, groups, -1).mean(-1), p.view(b, groups, -1).sum(-1)
    sent = chosen.view(b, t, groups, -1).amax(-1).sum(1) * (groups / (limit * t))
    return torch.stack([(f * p).sum(-1), (f_group * p_group).sum(-1), (sent * p_group).sum(-1)], 1) * \
        torch.tensor(alphas)


class Balancing:
    """The run's `moe` section on transformers' own MoE blocks in one process. A hook on each router keeps the
    step's affinities and chosen experts; `loss()` is the balance loss to add to the step's LM loss (the mean over
    the global batch's sequences); `after_step()` moves the router biases by the step's expert loads."""

    def __init__(self, model: torch.nn.Module, section, config, global_batch_size: int):
        gamma, *alphas = PUBLISHED[config.model_type]
        groups = int(getattr(config, "n_group", 1) or 1)
        names = ("bias_update_speed", "seq_aux_alpha", "device_aux_alpha", "comm_aux_alpha")
        given = [getattr(section, n) for n in names]
        # Unset device and communication losses are off with one device group (they are constants then).
        defaults = [gamma, alphas[0]] + [a if groups > 1 else 0.0 for a in alphas[1:]]
        self.gamma, *self.alphas = [float(d if g is None else g) for g, d in zip(given, defaults)]
        self.groups, self.limit = groups, int(getattr(config, "topk_group", 1) or groups)
        self.model_type = config.model_type
        self.experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.global_batch_size = global_batch_size
        self.routers = {name: m.gate for name, m in model.named_modules()
                        if isinstance(getattr(m, "gate", None), ROUTERS)}
        self.seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (block, logits (B, T, E), experts (B, T, K))
        self.terms = torch.zeros(3)

    @property
    def active(self) -> bool:
        return self.gamma > 0 or any(a > 0 for a in self.alphas)

    def attach(self) -> Balancing:
        for name, router in self.routers.items():
            router.register_forward_hook(lambda m, args, out, name=name: self.seen.append(
                (name, out[0].view(*args[0].shape[:2], -1), out[2].view(*args[0].shape[:2], -1))))
        return self

    def loss(self) -> torch.Tensor:
        args = (self.alphas, self.top_k, self.groups, self.limit, self.model_type)
        total = sum(balance_terms(logits, experts, *args).sum(0) for _, logits, experts in self.seen)
        self.terms += total.detach()
        return total.sum() / self.global_batch_size

    def after_step(self) -> dict:
        """The step's logged balance losses and, with gamma > 0, b_i += gamma * sign(mean load - load_i)."""
        args = (self.top_k, self.groups, self.limit, self.model_type)
        log = {"routing_margin": min(routing_margin(logits, getattr(self.routers[block], BIAS, None), *args)
                                     for block, logits, _ in self.seen)}
        if any(a > 0 for a in self.alphas):
            means = (self.terms / self.global_batch_size).tolist()
            log["aux_loss"] = sum(means)
            log.update({f"aux_loss_{k}": v for k, v, a in zip(("seq", "device", "comm"), means, self.alphas) if a > 0})
        with torch.no_grad():
            for name, router in self.routers.items():
                bias = getattr(router, BIAS, None)
                if self.gamma > 0 and bias is not None:
                    load = sum(torch.bincount(e.reshape(-1), minlength=self.experts).double()
                               for block, _, e in self.seen if block == name)
                    bias.add_((self.gamma * torch.sign(load.mean() - load)).float())
        log["biases"] = {name: getattr(r, BIAS).clone() for name, r in self.routers.items()
                         if getattr(r, BIAS, None) is not None}
        self.seen.clear()
        self.terms.zero_()
        return log


def reference_optimizer(params: list, t) -> tuple:
    """torch AdamW and the run's learning-rate schedule (train section `t`), stepped once as training starts."""
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    # The learning-rate schedule is an input here, not what is tested: use the same schedule class.
    sched = WarmupCosineLR(opt, total_num_steps=t.steps, warmup_num_steps=max(t.warmup_steps, 1),
                           warmup_min_ratio=1.0 / t.warmup_steps if t.warmup_steps else 1.0,
                           cos_min_ratio=t.min_lr / t.lr, warmup_type="linear")
    sched.step()
    return opt, sched


def reference_losses(cfg: RunConfig, data_dir: str, moe_log: list | None = None, mtp_log: list | None = None,
                     grad_norms: list | None = None, first_grads: dict | None = None) -> list[float]:
    """moe_log: if given, gets each step's aux_loss (and its terms) and router biases (by block name); mtp_log: each
    step's [L_main, L_1, ..., L_D] (MTP models); grad_norms: each step's gradient norm before clipping; first_grads:
    every parameter's gradient of step 1 by HF name, before clipping. With data.document_mask transformers gets the
    position ids (attention within each document); a chat dataset's prompt and padding labels are -100 as its files
    say. An MoE reference must keep clear of routing ties (assert_clear_of_routing_ties)."""
    moe_log = [] if moe_log is None else moe_log
    torch.manual_seed(cfg.train.seed)
    model, mcfg, mtp = reference_model(cfg, with_mtp=True)
    model.train()
    t = cfg.train
    whole = model if mtp is None else torch.nn.ModuleList([model, mtp])
    balancing = Balancing(whole, cfg.moe, mcfg, t.global_batch_size) if mcfg.model_type in PUBLISHED else None
    balancing = balancing.attach() if balancing and balancing.active else None
    params = list({id(p): p for p in whole.parameters()}.values())  # the shared embedding and head once
    opt, sched = reference_optimizer(params, t)
    data = _samples(data_dir, cfg)
    losses = []
    for step in range(1, t.steps + 1):
        (input_ids, labels, *positions), = step_batch(data, step, t.global_batch_size, t.seed, t.shuffle)
        if mtp is not None:
            loss, parts = mtp_reference_loss(model, mtp, input_ids, labels, t.mtp_loss_weight)
            if mtp_log is not None:
                mtp_log.append(parts)
        else:
            logits = model(input_ids=input_ids, position_ids=positions[0] if positions else None).logits
            loss = model.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=mcfg.vocab_size)
        (loss + balancing.loss() if balancing else loss).backward()
        if first_grads is not None and step == 1:
            first_grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        if grad_norms is not None:
            grad_norms.append(norm.item())
        opt.step()
        if balancing:
            moe_log.append(balancing.after_step())
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    if balancing:
        assert_clear_of_routing_ties(moe_log)
    return losses


def _samples(data_dir: str, cfg: RunConfig):
    """The dataset's sequences read from its files: a chat dataset's (prompt and padding labels -100) or a text one's."""
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    if meta.get("format") == "chat":
        return ChatSamples(data_dir, cfg.data.seq_len)
    return StreamSamples(data_dir, cfg.data.seq_len, document_mask=cfg.data.document_mask)


def initial_adapters(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """HF name -> tensor of the adapters a LoRA run of `cfg` starts from on any layout: models.lora draws each from
    the run's seed and its module's HF name (an input of the reference, as the seeded base weights are)."""
    from deepseek_ds.models.lora import apply_lora

    mcfg = prepare_config(build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides))
    layers = local_layers(build_model(mcfg, 1, seed=None))
    apply_lora(torch.nn.ModuleList(layers), cfg.lora, mcfg, cfg.train.seed)
    return {n: t.detach().clone() for n, t in hf_state_dict(layers).items() if ".lora_" in n}


def peft_model(cfg: RunConfig, base_dir: str, initial: dict[str, torch.Tensor], attn_implementation: str = "sdpa"):
    """transformers' model of base_dir with peft's adapters on it (in train mode), holding the initial adapters (HF
    name -> tensor); they alone require gradients."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = prepare_config(AutoConfig.from_pretrained(base_dir), attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(base_dir, config=config, dtype=torch.float32)
    # Written out, not models/lora.py's: r 4 and alpha 8 on the family's default targets (DeepSeek: the MLA
    # projections; Llama / Qwen2: attention and MLP), and with lora.routed_experts on transformers' fused experts.
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules) == (4, 8, None)
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] if config.model_type in PUBLISHED \
        else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if cfg.lora.routed_experts else None
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                       target_parameters=experts), model)
    params = dict(model.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == set(initial)
    with torch.no_grad():
        for name, t in initial.items():
            params[name].copy_(t)
    return model.train()


def lora_reference_losses(cfg: RunConfig, base_dir: str, data_dir: str, initial: dict[str, torch.Tensor],
                          grad_norms: list | None = None) -> list[float]:
    """transformers + peft + torch AdamW over the adapters in one process, from the same initial adapters (HF name
    -> tensor) and the same global batches; transformers' own causal-LM loss plus, for MoE models, the balancing
    above. grad_norms: each step's gradient norm (of the adapters) before clipping."""
    model = peft_model(cfg, base_dir, initial)
    config, params = model.config, dict(model.named_parameters())
    trainable = set(initial)
    moe = config.model_type in PUBLISHED
    t = cfg.train
    # MoE balancing as in training: the balance loss reaches the adapters, the router biases (buffers) move.
    balancing = Balancing(model, cfg.moe, config, t.global_batch_size).attach() if moe else None
    opt, sched = reference_optimizer([params[n] for n in sorted(trainable)], t)
    data = StreamSamples(data_dir, cfg.data.seq_len)
    out = []
    for step in range(1, t.steps + 1):
        (input_ids, labels), = step_batch(data, step, t.global_batch_size, t.seed, t.shuffle)
        logits = model(input_ids=input_ids).logits
        loss = model.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=config.vocab_size)
        (loss + balancing.loss() if balancing else loss).backward()
        norm = torch.nn.utils.clip_grad_norm_([params[n] for n in trainable], t.grad_clip)
        if grad_norms is not None:
            grad_norms.append(norm.item())
        opt.step()
        if balancing:
            balancing.after_step()
        sched.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


# ----------------------------------------------------------------------------------------------- packed sequences
IGNORE_INDEX = -100


def random_samples(n: int, vocab_size: int, max_len: int, gen: torch.Generator, min_len: int = 2) -> list[tuple]:
    """n (input_ids, labels) samples of min_len..max_len tokens, labels shifted, each with a -100 prompt prefix of up
    to half its length (as chat data has), the last label -100 (nothing follows the sample)."""
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (), generator=gen))
        tokens = torch.randint(1, vocab_size, (length + 1,), generator=gen)
        labels = tokens[1:].clone()
        labels[:int(torch.randint(0, length // 2 + 1, (), generator=gen))] = IGNORE_INDEX
        labels[-1] = IGNORE_INDEX
        out.append((tokens[:-1], labels))
    return out


def pack(samples: list[tuple], rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """First fit in order: whole samples into `rows` sequences of seq_len until either runs out, each rest padded
    (id 0, label -100, positions from 0 as a document of its own); positions restart at 0 at every sample. Returns
    (input_ids, labels, position_ids, the samples that were packed)."""
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros(rows, seq_len, dtype=torch.long)
    packed, queue, row, col = [], list(samples), 0, 0
    while queue and row < rows:
        x, y = queue[0]
        if col + len(x) > seq_len:
            positions[row, col:] = torch.arange(seq_len - col)
            row, col = row + 1, 0
            continue
        ids[row, col:col + len(x)], labels[row, col:col + len(x)] = x, y
        positions[row, col:col + len(x)] = torch.arange(len(x))
        packed.append(queue.pop(0))
        col += len(x)
    for r in range(row, rows):  # the rest of the last row used, and any row no sample reached, are padding
        positions[r, col if r == row else 0:] = torch.arange(seq_len - (col if r == row else 0))
    return ids, labels, positions, packed


def packed_global_batch(step: int, rows: int, seq_len: int, vocab_size: int, seed: int) -> tuple:
    """pack() of fresh random samples for training step `step` (1-based): the same on every rank and process."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return pack(random_samples(rows * seq_len // 2, vocab_size, seq_len // 2, gen), rows, seq_len)


def alone_token_loss(model, samples: list[tuple]) -> torch.Tensor:
    """The token-weighted causal-LM loss of the samples, each run alone (unpadded) through `model`."""
    total, tokens = 0.0, 0
    for x, y in samples:
        logits = model(input_ids=x.unsqueeze(0)).logits[0]
        total = total + F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
        tokens += int((y != IGNORE_INDEX).sum())
    return total / tokens


def packed_reference_losses(cfg: RunConfig) -> list[float]:
    """transformers + AdamW on the packed global batches of packed_global_batch, each step's loss the samples'
    token-weighted loss with every sample run alone: what training on the packed rows must reproduce."""
    torch.manual_seed(cfg.train.seed)
    model, mcfg = reference_model(cfg)
    model.train()
    t = cfg.train
    params = list({id(p): p for p in model.parameters()}.values())
    opt, sched = reference_optimizer(params, t)
    losses = []
    for step in range(1, t.steps + 1):
        *_, samples = packed_global_batch(step, t.global_batch_size, cfg.data.seq_len, mcfg.vocab_size, t.seed)
        loss = alone_token_loss(model, samples)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
