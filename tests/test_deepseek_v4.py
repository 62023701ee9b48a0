"""DeepSeek-V4 in one process: our pipeline layers compute transformers' DeepseekV4ForCausalLM, the hash tables and
lightning indexers are frozen as the issue sets, and every option V4's layers cannot train exactly is refused before
launch, one line each naming the field. (The layouts against a single-process reference: test_equivalence.py.)"""

import re

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from deepseek_ds.config import load_and_validate, run_config_from_dict
from deepseek_ds.models.deepseek_v4.layers import hash_table
from deepseek_ds.models.hf_io import hf_state_dict
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from helpers import refused

pytestmark = pytest.mark.unit

TWO_HASH = {"mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"]}


def tiny(overrides=None):
    return prepare_config(build_model_config("tiny-v4", None, overrides), "eager")


def transformers_twin(model, config) -> v4.DeepseekV4ForCausalLM:
    """transformers' own V4 model, built by its constructor, holding copies of our layers' weights and buffers."""
    hf = v4.DeepseekV4ForCausalLM(config)
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in hf_state_dict(local_layers(model)).items()},
                                             strict=False)
    assert not unexpected and all(k.endswith("inv_freq") for k in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize("overrides", [None, TWO_HASH], ids=["tiny-v4", "two-hash-layers"])
def test_logits_and_gradients_equal_transformers(overrides):
    config = tiny(overrides)
    ours = build_model(config, 1, seed=7).train()
    hf = transformers_twin(ours, config).train()
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    a, b = ours(ids), hf(input_ids=ids).logits
    assert torch.equal(a, b)
    for logits in (a, b):
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    ours_grads = {n: p.grad for n, p in hf_state_dict(local_layers(ours), keep_vars=True).items()
                  if isinstance(p, torch.nn.Parameter) and p.grad is not None}
    assert set(ours_grads) == set(grads)
    for name, g in grads.items():
        assert torch.equal(ours_grads[name], g), name


def test_hash_tables_and_indexers_are_frozen():
    config = tiny(TWO_HASH)
    model = build_model(config, 1, seed=7)
    params = dict(model.named_parameters())
    # The hash table is a buffer: no gradient, no optimizer state, no weight decay.
    assert not any(n.endswith("tid2eid") for n in params)
    tables = [m.tid2eid for m in model.modules() if isinstance(m, v4.DeepseekV4HashRouter)]
    assert len(tables) == 2
    for t in tables:
        # Each token's experts are distinct, and the vocabulary is spread over every expert (not all on expert 0).
        assert (t.sort(-1).values.diff(dim=-1) > 0).all()
        counts = torch.bincount(t.flatten(), minlength=config.n_routed_experts).float()
        assert counts.min() > 0.8 * counts.mean()
    assert not torch.equal(tables[0], tables[1])  # each layer's own seed
    assert torch.equal(tables[0], hash_table(config.vocab_size, config.n_routed_experts, config.num_experts_per_tok,
                                             7 * 1000 + 1))
    frozen = {n for n, p in params.items() if not p.requires_grad}
    assert frozen and all(".indexer." in n for n in frozen)
    assert {n for n in params if ".indexer." in n} == frozen
    # Only the indexers: the compressors' own projections train.
    assert any(".compressor.kv_proj" in n for n in params if n not in frozen)


@pytest.mark.parametrize("option,match", [
    ({"model": {"attn_implementation": "sdpa"}}, r"model.attn_implementation 'sdpa': deepseek_v4 runs on transformers' "
                                                 r"eager attention only.*set model.attn_implementation: eager"),
    ({"data": {"packing": True}}, r"data.packing / data.document_mask.*set data.packing: false"),
    ({"data": {"document_mask": True}}, r"data.packing / data.document_mask"),
    ({"parallel": {"sequence_parallel": 2}}, r"parallel.sequence_parallel: DeepSeek-V4.*set parallel.sequence_parallel: 1"),
    ({"parallel": {"tensor_parallel": 2}}, r"parallel.tensor_parallel: DeepSeek-V4.*set parallel.tensor_parallel: 1"),
    ({"parallel": {"expert_parallel": 2}}, r"parallel.expert_parallel: DeepSpeed's AutoEP has no DeepSeek-V4.*"
                                           r"set parallel.expert_parallel: 1"),
    ({"model": {"overrides": {"num_nextn_predict_layers": 1}}},
     r"num_nextn_predict_layers = 1.*no MTP module for deepseek_v4.*num_nextn_predict_layers: 0"),
    ({"lora": {"r": 4, "target_modules": "all-linear"}}, r"lora.target_modules 'all-linear': DeepSeek-V4's grouped"),
    ({"lora": {"r": 4, "target_modules": ["self_attn.o_a_proj"]}}, r"lora.target_modules \['self_attn.o_a_proj'\]"),
], ids=["sdpa", "packing", "document-mask", "sp", "tp", "ep", "mtp", "lora-all-linear", "lora-grouped-projection"])
def test_options_v4_cannot_train_exactly_are_refused(option, match):
    sections = {"model": {"preset": "tiny-v4", "attn_implementation": "eager"}, "train": {"micro_batch_size": 2,
                                                                                        "global_batch_size": 8}}
    for key, values in option.items():
        sections[key] = {**sections.get(key, {}), **values}
    message = refused(run_config_from_dict(sections), {"zero_optimization": {"stage": 1}}, 2, match)
    line = next(line for line in message.splitlines() if re.search(match, line))
    assert line.startswith("  - ")  # one line of its own


def test_the_recipe_and_its_defaults_pass():
    """recipes/tiny-v4.yaml as shipped is accepted (eager attention set, one sample per sequence)."""
    cfg, _ = load_and_validate("recipes/tiny-v4.yaml", None, [], 2)
    assert cfg.model.preset == "tiny-v4"


def test_lora_adapts_the_attention_projections_as_peft_does_on_transformers():
    """LoRA's default targets on V4: the attention's own projections only (not the compressors' or indexers' of the
    same names), and our adapted layers compute what peft's adapters on transformers' model compute."""
    from peft import inject_adapter_in_model

    from deepseek_ds.models.lora import ADAPTER, apply_lora, lora_config

    config = tiny()
    section = run_config_from_dict({"lora": {"r": 4, "alpha": 8}}).lora
    ours = build_model(config, 1, seed=7)
    hf = transformers_twin(ours, config)
    apply_lora(ours, section, config, seed=3)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in ours.named_parameters() if ".lora_A" in n}
    assert adapted and all(n.split(".")[-2] == "self_attn" for n in adapted), sorted(adapted)[:4]
    assert len(adapted) == 4 * config.num_hidden_layers
    inject_adapter_in_model(lora_config(section, config), hf, adapter_name=ADAPTER)
    # B starts at 0: both models' adapters moved by the same amount, so that they count in the logits.
    ours_adapters = {n: t for n, t in hf_state_dict(local_layers(ours), keep_vars=True).items() if ".lora_" in n}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if ".lora_" in name:
                ours_adapters[name].add_(0.01)
                param.copy_(ours_adapters[name])
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(ours(ids), hf(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_routers_score_in_fp32_under_bf16():
    """In bf16 the routers choose the experts an fp32 computation of the same (bf16) weights and inputs chooses, as
    DeepSeek's code does; transformers' own bf16 scoring chooses differently for some tokens."""
    config = tiny()
    model = build_model(config, 1, seed=7).to(torch.bfloat16)
    routers = [m for m in model.modules() if isinstance(m, v4.DeepseekV4TopKRouter)]
    seen = []
    for r in routers:
        r.register_forward_hook(lambda m, args, out: seen.append((m, args[0].detach(), out)))
    ids = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids)
    differs = 0
    for router, hidden, (logits, weights, indices) in seen:
        flat = hidden.reshape(-1, config.hidden_size).float()
        scores = F.softplus(flat @ router.weight.float().T).sqrt()
        want = torch.topk(scores + router.e_score_correction_bias, config.num_experts_per_tok, dim=-1).indices
        assert logits.dtype == torch.float32
        assert torch.equal(indices.sort(-1).values, want.sort(-1).values)
        chosen = scores.gather(1, indices)
        assert torch.equal(weights, (chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * config.routed_scaling_factor)
                           .to(torch.bfloat16))
        in_bf16 = torch.topk(F.softplus(F.linear(hidden.reshape(-1, config.hidden_size), router.weight)).sqrt()
                             + router.e_score_correction_bias, config.num_experts_per_tok, dim=-1).indices
        differs += int((in_bf16.sort(-1).values != want.sort(-1).values).any(-1).sum())
    assert differs > 0  # the fp32 scoring matters at these sizes


def test_right_padded_samples_equal_each_sample_alone():
    """One chat sample per sequence, right-padded (data.packing false): every real token's logits equal those of the
    sample alone in transformers' model, whatever the padding after it (the compressors' windows over the padding
    only reach later positions)."""
    config = tiny()
    ours = build_model(config, 1, seed=7).eval()
    hf = transformers_twin(ours, config).eval()
    gen = torch.Generator().manual_seed(5)
    lengths = [64, 37, 33, 9]
    batch = torch.zeros(len(lengths), 64, dtype=torch.long)  # pad id 0, as the chat data pads
    samples = [torch.randint(1, config.vocab_size, (n,), generator=gen) for n in lengths]
    for row, sample in enumerate(samples):
        batch[row, :len(sample)] = sample
    with torch.no_grad():
        logits = ours(batch)
        for row, sample in enumerate(samples):
            alone = hf(input_ids=sample.unsqueeze(0)).logits[0]
            assert torch.allclose(logits[row, :len(sample)], alone, rtol=0, atol=1e-5), lengths[row]
