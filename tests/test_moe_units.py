"""MoE load balancing in one process: the bias update rule and the balance losses against hand computations,
and the balance loss's gradient through the hooks against adding it to the loss by hand."""

import copy
import math
import re

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from deepseek_ds.config import MoESection, load_run_config
from deepseek_ds.models.moe import (
    BalanceSettings,
    LoadBalancer,
    balance_losses,
    moe_blocks,
    resolve_settings,
    restore_fp32_biases,
    snapshot_biases,
)
from deepseek_ds.models.pipeline import build_model, prepare_config
from deepseek_ds.models.presets import build_model_config
from reference import balance_terms

pytestmark = pytest.mark.unit

GAMMA = 1e-3


def toy_block() -> DeepseekV3MoE:
    """4 experts, top-1, one group; router weight 10 x identity: a one-hot token e_j goes to expert j."""
    cfg = DeepseekV3Config(hidden_size=4, moe_intermediate_size=2, n_routed_experts=4, num_experts_per_tok=1,
                           n_group=1, topk_group=1, n_shared_experts=1)
    block = DeepseekV3MoE(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(10 * torch.eye(4))
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            p.normal_(0, 0.1)
    return block


def settings(**kw) -> BalanceSettings:
    base = dict(bias_update_speed=GAMMA, seq_aux_alpha=0.0, device_aux_alpha=0.0, comm_aux_alpha=0.0, device_groups=1,
                device_limit=1, score_func="sigmoid", num_experts=4, top_k=1)
    return BalanceSettings(**{**base, **kw})


def tokens(experts: list[list[int]]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(experts), 4).float()


def test_bias_update_equals_hand_computation():
    block = toy_block().train()
    balancer = LoadBalancer(block, settings(), aux_grad_scale=1.0, global_batch_size=2, device="cpu")
    bias = block.gate.e_score_correction_bias
    # Step 1: loads [4, 1, 1, 0], mean 1.5: bias -= gamma where overloaded, += gamma elsewhere.
    block(tokens([[0, 0, 1], [0, 2, 0]]))
    block.eval()(tokens([[3, 3, 3]]))  # evaluation is not training traffic
    block.train()
    balancer.apply_load(balancer.counts, skipped=False)
    want = torch.tensor([-GAMMA, GAMMA, GAMMA, GAMMA], dtype=torch.float32)
    assert torch.equal(bias, want) and bias.dtype == torch.float32
    # A step DeepSpeed skipped moves nothing, and its counts do not leak into the next step.
    block(tokens([[0, 0, 0], [0, 0, 0]]))
    balancer.apply_load(balancer.counts, skipped=True)
    assert torch.equal(bias, want)
    # Step 3, two micro-batches, one under activation checkpointing (its recomputation is not counted again):
    # loads [1, 1, 1, 3], mean 1.5.
    block(tokens([[0, 1, 2]]))
    x = tokens([[3, 3, 3]]).requires_grad_()
    checkpoint(block, x, use_reentrant=False).sum().backward()
    balancer.apply_load(balancer.counts, skipped=False)
    want = want + torch.tensor([GAMMA, GAMMA, GAMMA, -GAMMA], dtype=torch.float32)
    assert torch.equal(bias, want)
    # gamma = 0: off.
    off = LoadBalancer(block, settings(bias_update_speed=0.0), 1.0, 2, "cpu")
    block(tokens([[0, 0, 0]]))
    off.apply_load(off.counts, skipped=False)
    balancer.counts.zero_()
    assert torch.equal(bias, want)


def hand_balance_loss(logits, chosen, k, alpha, device_alpha=0.0, groups=1, score_func="sigmoid", comm_alpha=0.0,
                      limit=1) -> list[float]:
    """DeepSeek-V3 eq. 17-20 and DeepSeek-V2 eq. 12-20 for one sequence (DeepSeek-V4: V3's on sqrt(softplus)
    affinities), written out with Python loops: [sequence-wise / expert-level, device-level, communication]."""
    t, e = len(logits), len(logits[0])
    s = []
    for row in logits:
        if score_func == "sigmoid":
            raw = [1 / (1 + math.exp(-v)) for v in row]
        elif score_func == "sqrtsoftplus":
            raw = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        else:
            z = sum(math.exp(v) for v in row)
            raw = [math.exp(v) / z for v in row]
        s.append([v / sum(raw) for v in raw])
    f = [e / (k * t) * sum(1 for tok in chosen if i in tok) for i in range(e)]
    p = [sum(s[tok][i] for tok in range(t)) / t for i in range(e)]
    seq = alpha * sum(fi * pi for fi, pi in zip(f, p))
    device = comm = 0.0
    size = e // groups
    for d in range(groups):
        members = range(d * size, (d + 1) * size)
        device += device_alpha * (sum(f[j] for j in members) / size) * sum(p[j] for j in members)
        sent = sum(1 for tok in chosen if any(j in members for j in tok))  # tokens with an expert in group d
        comm += comm_alpha * (groups / (limit * t) * sent) * sum(p[j] for j in members)
    return [seq, device, comm]


@pytest.mark.parametrize("score_func,device_alpha,comm_alpha", [("sigmoid", 0.0, 0.0), ("softmax", 0.0, 0.0),
                                                                ("softmax", 0.05, 0.0), ("softmax", 0.05, 0.02),
                                                                ("sqrtsoftplus", 0.0, 0.0)])
def test_balance_loss_equals_hand_computation(score_func, device_alpha, comm_alpha):
    gen = torch.Generator().manual_seed(3)
    b, t, e, k, groups, limit = 2, 5, 8, 3, 4, 2
    logits = torch.randn(b, t, e, generator=gen, dtype=torch.float64)
    chosen = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(b * t)]).view(b, t, k)
    s = settings(seq_aux_alpha=0.01, device_aux_alpha=device_alpha, comm_aux_alpha=comm_alpha, device_groups=groups,
                 device_limit=limit, score_func=score_func, num_experts=e, top_k=k)
    got = balance_losses(logits, chosen, s)
    for i in range(b):
        want = hand_balance_loss(logits[i].tolist(), chosen[i].tolist(), k, 0.01, device_alpha, groups,
                                 score_func=score_func, comm_alpha=comm_alpha, limit=limit)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6)
    # Perfect balance gives alpha exactly (sum_i f_i P_i = 1): the loss measures imbalance, not scale. So does the
    # communication loss when every token's experts span exactly M groups, equally often.
    uniform = balance_losses(torch.zeros(1, 4, 4), torch.arange(4).view(1, 4, 1),
                             settings(seq_aux_alpha=0.01, comm_aux_alpha=0.02, device_groups=2, score_func=score_func))
    assert uniform[0].tolist() == pytest.approx([0.01, 0.0, 0.02], rel=1e-6)


@pytest.mark.parametrize("score_func,device_alpha,comm_alpha", [("sigmoid", 0.0, 0.0), ("softmax", 0.05, 0.02),
                                                                ("sqrtsoftplus", 0.0, 0.0)])
def test_reference_balance_losses_equal_hand_computation(score_func, device_alpha, comm_alpha):
    """tests/reference.py's own balance losses (the single-process reference's, written from the papers) against
    the same hand computation."""
    gen = torch.Generator().manual_seed(4)
    b, t, e, k, groups, limit = 2, 5, 8, 3, 4, 2
    logits = torch.randn(b, t, e, generator=gen, dtype=torch.float64)
    chosen = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(b * t)]).view(b, t, k)
    model_type = {"sigmoid": "deepseek_v3", "softmax": "deepseek_v2", "sqrtsoftplus": "deepseek_v4"}[score_func]
    got = balance_terms(logits, chosen, [0.01, device_alpha, comm_alpha], k, groups, limit, model_type)
    for i in range(b):
        want = hand_balance_loss(logits[i].tolist(), chosen[i].tolist(), k, 0.01, device_alpha, groups,
                                 score_func=score_func, comm_alpha=comm_alpha, limit=limit)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6)


def test_balance_loss_gradient_through_hooks_equals_adding_it_to_the_loss():
    mcfg = build_model_config("tiny-v3")
    torch.manual_seed(0)
    hooked = DeepseekV3MoE(mcfg).train()
    for p in hooked.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    by_hand = copy.deepcopy(hooked)
    # A large alpha and a small main loss, so that the balance loss's share of the router gradient is far above
    # float32 rounding.
    s = resolve_settings(MoESection(seq_aux_alpha=1.0, bias_update_speed=0.0), mcfg)
    scale = 0.37
    # fp16's loss scale (here 4) multiplies the balance loss's gradient as it does the LM loss's.
    balancer = LoadBalancer(hooked, s, aux_grad_scale=scale / 4, global_batch_size=6, device="cpu", loss_scale=lambda: 4.0)
    x = torch.randn(3, 7, mcfg.hidden_size)
    w = torch.randn(3, 7, mcfg.hidden_size) * 1e-3
    (hooked(x) * w).sum().backward()

    out = by_hand(x)
    logits, _, idx = by_hand.gate(x)
    aux = balance_losses(logits.view(3, 7, -1), idx.view(3, 7, -1), s).sum()
    main = (out * w).sum()
    without_aux = torch.autograd.grad(main, by_hand.gate.weight, retain_graph=True)[0]
    (main + scale * aux).backward()
    for (name, a), b in zip(hooked.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8, msg=name)
    # The router weight really receives the balance loss's gradient: without it the gradient is another.
    grad = hooked.gate.weight.grad
    assert (grad - without_aux).abs().max() > 100 * (grad - by_hand.gate.weight.grad).abs().max()
    # The logged value is the mean over the global batch's sequences, with its one active term.
    logged = balancer.aux_metrics(balancer.take_aux().tolist())
    assert logged["aux_loss"] == pytest.approx(float(aux.detach()) / 6, rel=1e-9)
    assert logged["aux_loss_seq"] == logged["aux_loss"] and "aux_loss_device" not in logged


def test_family_defaults_and_overrides():
    v3 = resolve_settings(MoESection(), build_model_config("tiny-v3"))
    assert (v3.bias_update_speed, v3.seq_aux_alpha, v3.device_aux_alpha, v3.score_func) == (1e-3, 1e-4, 0.0, "sigmoid")
    v2 = resolve_settings(MoESection(), build_model_config("tiny-v2", overrides={"n_group": 2}))
    assert (v2.bias_update_speed, v2.seq_aux_alpha, v2.device_aux_alpha, v2.comm_aux_alpha, v2.score_func) == \
        (0.0, 3e-3, 0.05, 0.02, "softmax")
    one_group = resolve_settings(MoESection(), build_model_config("tiny-v2"))
    assert (one_group.device_aux_alpha, one_group.comm_aux_alpha) == (0.0, 0.0)  # n_group 1
    assert resolve_settings(MoESection(), build_model_config("deepseek-v2")).device_limit == 3  # M of DeepSeek-V2
    assert resolve_settings(MoESection(), build_model_config("tiny-dense")) is None
    cfg = load_run_config("recipes/tiny-v3.yaml", ["moe.bias_update_speed=0", "moe.seq_aux_alpha=2e-4"])
    off = resolve_settings(cfg.moe, build_model_config("tiny-v3"))
    assert (off.bias_update_speed, off.seq_aux_alpha) == (0.0, 2e-4)


def test_bias_update_lowers_the_expert_load_imbalance():
    """The bias update alone (fixed weights, fresh batches, forward passes) on routers that start skewed towards
    experts 0 and 1 (as a checkpoint's might): with gamma = 0 they stay skewed; with gamma > 0 the busiest expert's
    load over the mean falls by more than half."""
    mcfg = prepare_config(build_model_config("tiny-v3", overrides={"num_hidden_layers": 2}))
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, mcfg.vocab_size, (4, 64), generator=gen) for _ in range(30)]
    ratios = {}
    for gamma in (0.0, 0.02):
        model = build_model(mcfg, 1, seed=3).train()
        for _, router in moe_blocks(model).values():
            router.e_score_correction_bias[:2] = 0.2
        s = resolve_settings(MoESection(bias_update_speed=gamma, seq_aux_alpha=0.0), mcfg)
        balancer = LoadBalancer(model, s, aux_grad_scale=1.0, global_batch_size=4, device="cpu")
        history = []
        with torch.no_grad():
            for ids in batches:
                model(ids)
                load = balancer.counts.clone()
                history.append(float((load.amax(-1) / load.mean(-1)).mean()))
                balancer.apply_load(balancer.counts, skipped=False)
        ratios[gamma] = history
    start, off, on = ratios[0.0][0], sum(ratios[0.0][-5:]) / 5, sum(ratios[0.02][-5:]) / 5
    assert ratios[0.02][0] == start  # the same router before any update
    # 4.0 is every token on experts 0 and 1; what is left near 1.7 is the batches' noise and the bias's own +-gamma.
    assert start > 3.5 and off > 0.9 * start and on < 0.5 * off, ratios


def test_bias_stays_fp32_when_deepspeed_casts_buffers():
    """data_types.buffer_dtype makes DeepSpeed cast every buffer (`b.data = b.data.to(dtype)`): the exact fp32
    values come back, so steps of 1e-3 on a bias near 1 are not lost to bf16's 8-bit mantissa."""
    model = build_model(prepare_config(build_model_config("tiny-v3")), 1, seed=3)
    for _, router in moe_blocks(model).values():
        router.e_score_correction_bias.fill_(1.0).add_(torch.arange(8) * 1e-3)
    snapshot = snapshot_biases(model)
    for b in model.buffers():
        b.data = b.data.to(torch.bfloat16)
    restore_fp32_biases(model, snapshot)
    for _, router in moe_blocks(model).values():
        bias = router.e_score_correction_bias
        assert bias.dtype == torch.float32 and torch.equal(bias, 1.0 + torch.arange(8, dtype=torch.float32) * 1e-3)


@pytest.mark.parametrize("sets,message", [
    (["moe.seq_aux_alpha=-1"], "moe.seq_aux_alpha = -1.0 must be >= 0"),
    (["model.preset=tiny-v2", "moe.bias_update_speed=0.001"], "deepseek_v2 routers have no e_score_correction_bias"),
    (["model.preset=tiny-v2", "moe.device_aux_alpha=0.05"], "n_group is 1"),
    (["model.preset=tiny-v2", "moe.comm_aux_alpha=0.02"], "moe.comm_aux_alpha = 0.02 needs device groups"),
    (["model.preset=tiny-dense", "moe.seq_aux_alpha=0.001"], "is dense"),
    # 4 ranks, PP=2 x DP=2 x EP=2 with stage 0 = embedding + the dense layer 0 only: AutoEP would find no experts.
    (["parallel.pipeline_stages=2", "parallel.expert_parallel=2", "model.partition_method=counts:2,5"],
     "needs an MoE layer on every pipeline stage"),
])
def test_config_refusals(sets, message):
    from deepseek_ds.config import ConfigError, load_ds_config, validate

    ds = "ds_configs/zero1_pp.json" if any("pipeline" in s for s in sets) else "ds_configs/zero1.json"
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_run_config("recipes/tiny-v3.yaml", sets), load_ds_config(ds), 4)
    validate(load_run_config("recipes/tiny-v3.yaml", ["parallel.pipeline_stages=2", "parallel.expert_parallel=2"]),
             load_ds_config("ds_configs/zero1_pp.json"), 4)  # the balanced partition has experts on both stages
