"""GRPO's loss (models/grpo_loss.py) against TRL's GRPOTrainer._compute_loss on the same rollouts and weights: our
rows [prompt | completion | padding] through our pipeline layers, TRL's left-padded prompts with masks through
transformers' model sharing those weights. Each loss type, token and sequence importance sampling, with and without
the KL term: the loss and every parameter's gradient equal TRL's."""

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from deepseek_ds.models.grpo_loss import GRPOLoss, GRPOSettings, group_advantages
from deepseek_ds.models.hf_io import hf_state_dict, to_hf_model
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.training.objectives.grpo import _rows

pytestmark = pytest.mark.unit

MAX_COMPLETION = 7


def _rollouts(vocab: int, eos: int):
    """4 prompts of different lengths, 2 completions each (some end with EOS before MAX_COMPLETION), rewards."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 3, 6) for _ in range(2)]
    completions = []
    for k in range(len(prompts)):
        c = torch.randint(3, vocab, (MAX_COMPLETION,), generator=gen).tolist()
        completions.append(c[:2 + k % 4] + [eos] if k % 3 else c)
    rewards = torch.rand(len(prompts), generator=gen, dtype=torch.float64)
    return prompts, completions, rewards


def _trl_inputs(prompts, completions, advantages, ref, pad: int):
    """TRL's batch: prompts left-padded, completions right-padded, their masks."""
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.full((len(prompts), width_p), pad)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(prompts), width_c), pad)
    completion_mask = torch.zeros_like(completion_ids)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[r, width_p - len(p):], prompt_mask[r, width_p - len(p):] = torch.tensor(p), 1
        completion_ids[r, :len(c)], completion_mask[r, :len(c)] = torch.tensor(c), 1
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages.float(),
              "num_items_in_batch": completion_mask.sum()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return inputs


def _trl(model, s: GRPOSettings, temperature: float) -> GRPOTrainer:
    """A GRPOTrainer holding only what _compute_loss reads (one process, no accumulation), its model given TRL's
    fused LM head at the temperature, as GRPOTrainer.__init__ does."""
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    trainer = object.__new__(GRPOTrainer)
    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, is_main_process=True,
                                  autocast=contextlib.nullcontext, gather=lambda x: x,
                                  gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x)
    trainer.__dict__.update(
        model=model, beta=s.beta, loss_type=s.loss_type, epsilon_low=s.epsilon, epsilon_high=s.epsilon_high,
        importance_sampling_level=s.importance_sampling_level, temperature=temperature, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, max_completion_length=s.max_completion_length,
        accelerator=accelerator, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        model_kwarg_keys=set())
    return trainer


@pytest.mark.parametrize("loss_type,level,beta", [("grpo", "token", 0.0), ("dapo", "token", 0.04),
                                                  ("dr_grpo", "token", 0.0), ("grpo", "sequence", 0.04),
                                                  ("dapo", "sequence", 0.0)])
def test_loss_and_gradients_equal_trl(loss_type, level, beta):
    config = prepare_config(build_model_config("tiny-v3"), "eager")
    ours = build_model(config, 1, seed=5).train()
    hf = to_hf_model(local_layers(ours), config).train()  # our weights (its own Parameter objects: own gradients)
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else 1
    prompts, completions, rewards = _rollouts(config.vocab_size, eos)
    advantages, _ = group_advantages(rewards, 2, "group")
    s = GRPOSettings(beta, 0.2, 0.28, loss_type, level, MAX_COMPLETION)
    ids, starts, completion, mask = _rows(prompts, completions, "cpu")
    ref = None
    if beta:  # a reference that differs from the policy: the policy's log-probabilities, perturbed
        with torch.no_grad():
            ref = GRPOLoss(s, 0.7, []).logps(ours(ids), completion, starts)
        ref = ref + 0.3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))

    trl_loss = _trl(hf, s, 0.7)._compute_loss(hf, _trl_inputs(prompts, completions, advantages, ref, 0))
    trl_loss.backward()
    want = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}

    loss_fn = GRPOLoss(s, 0.7, [])
    loss = loss_fn(ours(ids), completion, starts, mask, advantages.float(), ref, torch.tensor(float(len(prompts))),
                   mask.sum().double(), 1)
    loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    got = {n: p.grad for n, p in hf_state_dict(local_layers(ours), keep_vars=True).items()
           if isinstance(p, torch.nn.Parameter) and p.grad is not None}
    assert set(got) == set(want) and len(want) > 20
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-9, name
    metrics = loss_fn.metrics(loss_fn.take_parts("cpu").tolist())
    assert metrics["completion_length"] == pytest.approx(mask.sum().item() / len(prompts))
    assert (metrics["kl"] > 0) == bool(beta)


# ----------------------------------------------------------------------------------------------- through the launcher
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
STEPS = 2
SETS = [f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8", "data.seq_len=64",
        "train.warmup_steps=0", "checkpoint.interval=0", "eval.interval=0", "train.seed=3", "train.objective=grpo",
        "grpo.num_generations=4", "grpo.max_completion_length=6", "grpo.temperature=0.9", "grpo.beta=0.04",
        "grpo.reward=[tests/grpo_rewards.py:vowel_share]", "model.attn_implementation=eager",
        # Adam's eps as test_equivalence's: gradient entries near 0 would otherwise turn roundoff between layouts into
        # whole lr-sized steps.
        "train.eps=1e-5"]
ITERATIONS = ["grpo.num_iterations=2"]
# LoRA on a base `models init` wrote with the prompts' tokenizer: its reference is that base, the adapters off.
LORA = ["model.preset=null", "model.path={base}", "lora.r=4", "lora.alpha=8"]
GRPO_LAYOUTS = [("grpo-zero1", "ds_configs/zero1.json", []), ("grpo-zero3", "ds_configs/zero3.json", []),
                # Step 1, saved; then the same directory again to step 2: it resumes from step 1.
                ("grpo-resumed", "ds_configs/zero1.json", ["train.steps=1", "checkpoint.interval=1"]),
                ("grpo-resumed", "ds_configs/zero1.json", ["checkpoint.interval=1"]),
                ("grpo-lora-zero1", "ds_configs/zero1.json", LORA),
                # One generation, two updates on it.
                ("grpo-iterations2", "ds_configs/zero1.json", ITERATIONS),
                ("grpo-replay", "ds_configs/zero1.json", ["grpo.router_replay=true"]),
                # Expert parallelism: rollouts and reference from every expert, gathered; replay on AutoEP's router.
                ("grpo-ep2", "ds_configs/zero1.json", ["parallel.expert_parallel=2"]),
                ("grpo-replay-ep2", "ds_configs/zero1.json", ["grpo.router_replay=true", "parallel.expert_parallel=2"])]


@pytest.fixture(scope="module")
def prompts_data(tmp_path_factory) -> str:
    """60 prompts of a few words, prepared with their own 300-token BPE (no validation split)."""
    import json

    import numpy as np

    from helpers import cli

    root = tmp_path_factory.mktemp("prompts")
    rng = np.random.default_rng(0)
    with open(root / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": " ".join(rng.choice(WORDS, size=int(rng.integers(1, 6)))),
                                 "answer": str(rng.choice(WORDS))}) + "\n" for _ in range(60))
    assert cli(["data", "prepare", "--format", "prompts", "--input", str(root / "prompts.jsonl"), "--vocab-size",
                "300", "--valid-fraction", "0", "--out", str(root / "data"), "--no-progress"]) == 0
    return str(root / "data")


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory, prompts_data) -> str:
    import os

    from deepseek_ds.data.layout import TOKENIZER_DIR
    from helpers import cli

    out = str(tmp_path_factory.mktemp("grpo_base") / "hf")
    assert cli(["models", "init", "--preset", "tiny-v3", "--tokenizer", os.path.join(prompts_data, TOKENIZER_DIR),
                "--out", out]) == 0
    return out


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory, prompts_data, lora_base):
    from helpers import train_layouts

    layouts = [(name, ds, [s.format(base=lora_base) for s in extra]) for name, ds, extra in GRPO_LAYOUTS]
    return train_layouts(2, tmp_path_factory.mktemp("grpo"), layouts, SETS + [f"data.path={prompts_data}"])


@pytest.mark.launch
@pytest.mark.parametrize("name", ["grpo-zero1", "grpo-zero3", "grpo-ep2"])
def test_rollouts_rewards_advantages_and_gradient_norm_equal_a_recomputation(name, grpo_runs, prompts_data):
    """Step 1 of a 2-rank run: the rollouts file's rewards equal the reward function on the decoded completions, its
    advantages the group formula, and the step's gradient norm (before clipping) the norm of TRL's GRPO loss on those
    rollouts, computed on transformers' model from the same starting weights in one process; kl is 0 at step 1
    (policy = reference) and positive at step 2."""
    import json

    from deepseek_ds.config import load_run_config
    from deepseek_ds.data import load_tokenizer
    from grpo_rewards import vowel_share
    from helpers import read_metrics
    from reference import reference_model

    out = grpo_runs[name]
    rows = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    first = [r for r in rows if r["step"] == 1]
    assert len(first) == 8 and {r["step"] for r in rows} == set(range(1, STEPS + 1))
    tokenizer = load_tokenizer(prompts_data)
    texts = [tokenizer.decode(r["completion_ids"], skip_special_tokens=True) for r in first]
    assert [r["reward"] for r in first] == pytest.approx(vowel_share(None, texts, None), abs=1e-12)
    rewards = torch.tensor([r["reward"] for r in first], dtype=torch.float64).view(-1, 4)
    want = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    assert [r["advantage"] for r in first] == pytest.approx(want.tolist(), rel=1e-5, abs=1e-6)
    assert want.abs().max() > 0.1  # the rewards vary within groups: the step has a gradient

    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [f"data.path={prompts_data}"])
    hf, _ = reference_model(cfg)
    hf.train()
    trl, prompts, completions, ref = _trl_on(hf, cfg, first)  # the reference: the policy itself at step 1
    trl._compute_loss(hf, _trl_inputs(prompts, completions, torch.tensor([r["advantage"] for r in first]), ref,
                                      0)).backward()
    norm = torch.sqrt(sum(p.grad.double().norm() ** 2 for p in hf.parameters() if p.grad is not None)).item()
    records = read_metrics(str(out))
    assert records[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-9) and records[1]["kl"] > 1e-7
    assert records[0]["reward"] == pytest.approx(sum(r["reward"] for r in first) / 8, rel=1e-9)
    if name == "grpo-ep2":  # and step 2, after an update of experts held apart, as ZeRO-1's
        zero1 = read_metrics(str(grpo_runs["grpo-zero1"]))
        for key in ("loss", "grad_norm", "kl", "reward"):
            assert [r[key] for r in records] == pytest.approx([r[key] for r in zero1], rel=1e-5, abs=1e-9), key
    for r in records:  # the step's time split: each phase took time, and together no more than the step
        phases = [r[f"time_{p}"] for p in ("generation", "reference", "update")]
        assert min(phases) > 0 and sum(phases) <= r["step_time"] * 1.05, (phases, r["step_time"])


@pytest.mark.launch
def test_lora_rollouts_and_gradient_norm_equal_trl_on_peft(grpo_runs, prompts_data, lora_base):
    """LoRA: step 1's gradient norm (the adapters') equals that of TRL's GRPO loss on the same rollouts, computed on
    transformers' model of the base with peft's adapters from the same initial values; the reference is the base
    (the adapters off), equal to the policy at step 1 (B = 0), so kl is 0 there and positive at step 2."""
    import json

    from deepseek_ds.config import load_run_config
    from helpers import read_metrics
    from reference import initial_adapters, peft_model

    out = grpo_runs["grpo-lora-zero1"]
    first = [r for r in map(json.loads, open(out / "rollouts.jsonl")) if r["step"] == 1]
    assert len(first) == 8
    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + [s.format(base=lora_base) for s in LORA]
                          + [f"data.path={prompts_data}"])
    initial = initial_adapters(cfg)
    model = peft_model(cfg, lora_base, initial, "eager")
    trl, prompts, completions, ref = _trl_on(model, cfg, first)  # B = 0: the base's, the reference's
    trl._compute_loss(model, _trl_inputs(prompts, completions, torch.tensor([r["advantage"] for r in first]), ref,
                                         0)).backward()
    params = dict(model.named_parameters())
    assert all(params[n].grad is not None for n in initial)
    norm = torch.sqrt(sum(params[n].grad.double().norm() ** 2 for n in initial)).item()
    records = read_metrics(str(out))
    assert records[0]["grad_norm"] == pytest.approx(norm, rel=1e-5) and norm > 0
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-9) and records[1]["kl"] > 1e-9


@pytest.mark.launch
def test_two_iterations_update_twice_on_one_generation_as_trl(grpo_runs, prompts_data):
    """grpo.num_iterations 2: one generation (step 1's rollouts, the same as one iteration's) and two updates on it.
    Step 1 equals the one-iteration run's; step 2's gradient norm equals TRL's loss on those rollouts with the
    sampling policy's log-probabilities as old_per_token_logps, on transformers' model after a torch AdamW step of
    step 1's clipped gradient (the ratio is no longer 1 there)."""
    import json

    from deepseek_ds.config import load_run_config
    from helpers import read_metrics
    from reference import reference_model, reference_optimizer

    out = grpo_runs["grpo-iterations2"]
    rows = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    first = [r for r in map(json.loads, open(grpo_runs["grpo-zero1"] / "rollouts.jsonl")) if r["step"] == 1]
    assert rows == first  # sampled once, at step 1, from the same weights
    records, single = read_metrics(str(out)), read_metrics(str(grpo_runs["grpo-zero1"]))
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["grad_norm"] == pytest.approx(single[0]["grad_norm"], rel=1e-6)
    assert records[1]["reward"] == records[0]["reward"]  # the same completions

    cfg = load_run_config("recipes/tiny-v3.yaml", SETS + ITERATIONS + [f"data.path={prompts_data}"])
    hf, _ = reference_model(cfg)
    hf.train()
    # The starting model: the reference, and the policy that sampled.
    trl, prompts, completions, start = _trl_on(hf, cfg, rows)
    inputs = _trl_inputs(prompts, completions, torch.tensor([r["advantage"] for r in rows]), start, 0)
    inputs["old_per_token_logps"] = start
    params = [p for p in hf.parameters() if p.requires_grad]
    opt, sched = reference_optimizer(params, cfg.train)
    norms = []
    for _ in range(2):
        trl._compute_loss(hf, inputs).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip).item())
        opt.step()
        sched.step()
        opt.zero_grad()
    # Step 1 agrees to ~9e-6 here (as in the recomputation test above); step 2 inherits that, not more. Where the
    # second update ignores the sampling policy (old = current) its norm is ~8x this one.
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=2e-5)
    assert records[1]["clip_ratio"] > 0  # the ratio moved past 1 +- epsilon: clipping acts


@pytest.mark.launch
@pytest.mark.parametrize("with_replay,without", [("grpo-replay", "grpo-zero1"), ("grpo-replay-ep2", "grpo-ep2")])
def test_router_replay_through_the_launcher(with_replay, without, grpo_runs):
    """grpo.router_replay on tiny-v3 (MoE; transformers' routers, and AutoEP's under expert parallelism): the
    rollouts are those of the run without it (recording does not change sampling), each step reports the share of
    routing decisions replay changed, and where it changed none (the training forward would have chosen the same
    experts) the step equals the run without replay."""
    import json

    from helpers import read_metrics

    def rows(name):
        return [json.loads(line) for line in open(grpo_runs[name] / "rollouts.jsonl")]

    assert [r for r in rows(with_replay) if r["step"] == 1] == [r for r in rows(without) if r["step"] == 1]
    replay, plain = read_metrics(str(grpo_runs[with_replay])), read_metrics(str(grpo_runs[without]))
    shares = [r["router_replay_changed"] for r in replay]
    assert all(0 <= share < 0.05 for share in shares), shares
    if shares[0] == 0:
        assert replay[0]["grad_norm"] == plain[0]["grad_norm"]
    else:
        assert replay[0]["grad_norm"] != plain[0]["grad_norm"]


@pytest.mark.launch
def test_a_resumed_run_draws_the_same_rollouts_and_steps_bitwise(grpo_runs):
    """Stopped after step 1 and resumed: step 2's rollouts (its sampling is seeded by the seed, step and rank) and
    metrics equal the uninterrupted run's exactly."""
    import json

    from helpers import read_metrics

    def rows(name):
        return [json.loads(line) for line in open(grpo_runs[name] / "rollouts.jsonl")]

    assert rows("grpo-resumed") == rows("grpo-zero1")
    resumed, straight = read_metrics(str(grpo_runs["grpo-resumed"])), read_metrics(str(grpo_runs["grpo-zero1"]))
    assert [r["step"] for r in resumed] == [1, 2]
    for key in ("loss", "grad_norm", "reward", "kl", "entropy"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key


def _trl_on(model, cfg, rows: list[dict]):
    """(TRL's trainer on `model` at the run's grpo settings, the rollout rows' prompts and completions, the model's
    log-probabilities of the completions, without gradient)."""
    g = cfg.grpo
    s = GRPOSettings(g.beta, g.epsilon, g.epsilon, g.loss_type, g.importance_sampling_level, g.max_completion_length)
    prompts, completions = [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows]
    trl = _trl(model, s, g.temperature)
    with torch.no_grad():
        logps = trl._get_per_token_logps_and_entropies(model, *_joined(prompts, completions),
                                                       max(map(len, completions)))[0]
    return trl, prompts, completions, logps


def _joined(prompts, completions):
    """TRL's (input ids, attention mask) of left-padded prompts followed by right-padded completions."""
    inputs = _trl_inputs(prompts, completions, torch.zeros(len(prompts)), None, 0)
    return (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))


def test_router_replay_routes_each_token_as_recorded_and_the_router_still_learns():
    """The experts each token of a sampled completion was routed to (recorded on transformers' model while it
    generated) are exactly those the training forward of our layers uses, also where they are not what our router
    would choose (records moved to other experts); the gate weights come from the training router, which gets a
    gradient; and the unmoved records match what our forward would choose for nearly every decision."""
    from deepseek_ds.models.router_replay import RouterReplay, RoutingRecorder, _layer_routers
    from deepseek_ds.training.evaluation import generate_batch

    config = prepare_config(build_model_config("tiny-v3"), "eager")
    ours = build_model(config, 1, seed=5).train()
    hf = to_hf_model(local_layers(ours), config)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (4, 7, 5)]
    recorder = RoutingRecorder(hf)
    torch.manual_seed(0)
    completions = generate_batch(hf, prompts, 6, 0, 1, {"temperature": 1.0, "top_k": 0}, keep_eos=True)
    rows = recorder.take(prompts, completions)
    ids, _, _, _ = _rows(prompts, completions, "cpu")
    replay = RouterReplay(ours, "sigmoid", config.norm_topk_prob, config.routed_scaling_factor, "cpu")

    replay.replaying(rows, ids.shape[1])
    ours(ids).float().pow(2).mean().backward()
    changed, replayed = replay.take().tolist()
    assert replayed == sum(sum(r[layer].shape[0] for r in rows) for layer in rows[0]) and changed <= 0.02 * replayed

    moved = [{layer: (e + 1) % config.n_routed_experts for layer, e in r.items()} for r in rows]
    used = {}
    for layer, router in _layer_routers(ours).items():
        router.register_forward_hook(lambda m, a, out, layer=layer: used.__setitem__(layer, out[2]))
    ours.zero_grad(set_to_none=True)
    replay.replaying(moved, ids.shape[1])
    ours(ids).float().pow(2).mean().backward()
    for layer, chosen in used.items():
        chosen = chosen.view(len(rows), ids.shape[1], -1)
        for r, row in enumerate(moved):
            assert torch.equal(chosen[r, :row[layer].shape[0]], row[layer]), (layer, r)
    assert replay.take()[0] > 0.5 * replayed  # moved: nearly every decision differs from the router's own
    assert all(router.weight.grad.abs().max() > 0 for router in _layer_routers(ours).values())


def test_router_replay_on_autoep_router_routes_as_recorded_with_its_own_weights():
    """Under expert parallelism the training forward's router is DeepSpeed AutoEP's TokenChoiceTopKRouter: replay
    returns the recorded experts, their weights by its formula (scores of those experts, normalised, scaled) from its
    own gate, and its token counts; its gate gets a gradient."""
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter
    from torch import nn

    from deepseek_ds.models.router_replay import RouterReplay

    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(16, 8, None, None, 2, "sigmoid", True, 2.5, False)
    mlp = nn.Module()
    mlp.router = router
    model = nn.Module()  # layer spec 1 holds decoder layer 0, as in SequentialLM
    model.layers = nn.Sequential(nn.Module(), nn.Module())
    model.layers[1].layer = nn.Module()
    model.layers[1].layer.mlp = mlp
    replay = RouterReplay(model.train(), "sigmoid", False, 1.0, "cpu")
    x = torch.randn(2 * 5, 16)
    _, free_experts, _ = router(x)
    recorded = [{0: (free_experts.view(2, 5, 2)[r, :4] + 3) % 8} for r in range(2)]  # 4 known tokens of 5, moved
    replay.replaying(recorded, 5)
    weights, experts, counts = router(x)
    chosen = experts.view(2, 5, 2)
    for r in range(2):
        assert torch.equal(chosen[r, :4], recorded[r][0])
    assert torch.equal(chosen[:, 4], free_experts.view(2, 5, 2)[:, 4])  # no record: its own choice
    scores = torch.sigmoid(router.gate(x).float()).gather(1, experts)
    assert torch.allclose(weights, scores / scores.sum(-1, keepdim=True) * 2.5)
    assert torch.equal(counts.long(), torch.bincount(experts.flatten(), minlength=8))
    changed, replayed = replay.take().tolist()
    assert replayed == 8 and changed == 8
    weights.sum().backward()
    assert router.gate.weight.grad.abs().max() > 0


@pytest.mark.parametrize("preset,match", [("tiny-dense", "grpo.router_replay: llama has no routed experts"),
                                          ("tiny-v4", "grpo.router_replay: deepseek_v4 has sqrtsoftplus routers")])
def test_router_replay_is_refused_where_it_cannot_replay(preset, match):
    from deepseek_ds.config import run_config_from_dict
    from helpers import refused

    cfg = run_config_from_dict({"model": {"preset": preset}, "train": {"objective": "grpo"},
                                "grpo": {"router_replay": True}})
    message = refused(cfg, {"zero_optimization": {"stage": 1}}, 1, match)
    assert next(line for line in message.splitlines() if match in line).startswith("  - grpo.router_replay: ")
