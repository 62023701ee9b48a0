"""DeepSeek-V3.2 with its lightning indexer frozen (transformers computes it without gradients), in one process: our
pipeline layers compute transformers' DeepseekV32ForCausalLM, the indexer selects (fewer keys than the sequence),
holds no trainable parameter, and what the layers cannot train exactly is refused. (Layouts: test_equivalence.py.)"""

import re

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

from deepseek_ds.config import run_config_from_dict
from deepseek_ds.models.deepseek_v32.indexer import TrainableIndexer, train_indexers
from deepseek_ds.models.deepseek_v32.indexer_loss import IndexerLoss
from deepseek_ds.models.hf_io import hf_state_dict
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config, split_micro_batch
from deepseek_ds.models.presets import build_model_config
from helpers import refused
from reference_indexer import indexer_loss_reference

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_and_gradients_equal_transformers(attn):
    config = prepare_config(build_model_config("tiny-v32"), attn)
    ours = build_model(config, 1, seed=7).train()
    hf = v32.DeepseekV32ForCausalLM(config).train()
    missing, unexpected = hf.load_state_dict(
        {k: v.detach().clone() for k, v in hf_state_dict(local_layers(ours)).items()}, strict=False)
    assert not unexpected and all(k.endswith("inv_freq") for k in missing), (missing, unexpected)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    a, b = ours(ids), hf(input_ids=ids).logits
    assert torch.equal(a, b)
    for logits in (a, b):
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    ours_params = {n: p for n, p in hf_state_dict(local_layers(ours), keep_vars=True).items()
                   if isinstance(p, torch.nn.Parameter)}
    for name, p in hf.named_parameters():
        assert (p.grad is None) == (ours_params[name].grad is None), name
        if p.grad is not None:
            assert torch.equal(ours_params[name].grad, p.grad), name


def test_the_indexer_selects_and_is_frozen():
    config = prepare_config(build_model_config("tiny-v32"), "sdpa")
    assert config.index_topk < 64  # the tests' 64-token sequences: the selection drops keys
    model = build_model(config, 1, seed=7)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if ".indexer." in n} and frozen
    # Without the selection (every key kept) the logits differ: the indexer takes part in the forward.
    dense = prepare_config(build_model_config("tiny-v32", None, {"index_topk": 64}), "sdpa")
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(model(ids), build_model(dense, 1, seed=7)(ids))


@pytest.mark.parametrize("option,match", [
    ({"model": {"attn_implementation": "flash_attention_2"}},
     r"deepseek_v32 runs on transformers' sdpa or eager attention only.*FlashMLA.*set model.attn_implementation: sdpa"),
    ({"parallel": {"sequence_parallel": 2}}, r"parallel.sequence_parallel: DeepSeek-V3.2's indexer"),
    ({"parallel": {"tensor_parallel": 2}}, r"parallel.tensor_parallel: DeepSeek-V3.2's indexer"),
    ({"indexer": {"stage": "warmup"}, "lora": {"r": 4}}, r"lora.r with indexer.stage warmup: .*set lora.r: 0"),
    ({"indexer": {"stage": "sparse"}, "train": {"objective": "dpo"}},
     r"train.objective dpo with indexer.stage sparse: .*set train.objective: lm"),
    ({"indexer": {"stage": "sparse"}, "model": {"preset": "tiny-v3"}},
     r"indexer.stage sparse: deepseek-ds trains the lightning indexer of DeepSeek-V3.2 .*not of deepseek_v3"),
    ({"indexer": {"stage": "warmup"}, "parallel": {"expert_parallel": 2}},
     r"parallel.expert_parallel with indexer.stage warmup: .*set parallel.expert_parallel: 1"),
    ({"indexer": {"stage": "sparse"}, "zero_optimization": {"stage": 0}},
     r"indexer.stage sparse with gradient clipping and ZeRO stage 0: .*clipped by their own norms.*train.grad_clip=0"),
    ({"indexer": {"stage": "sparse"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     r"indexer.stage sparse with gradient clipping and zero_optimization.offload_optimizer: "),
], ids=["flash", "sp", "tp", "indexer-lora", "indexer-dpo", "indexer-v3", "indexer-ep-warmup", "sparse-clip-zero0",
        "sparse-clip-offload"])
def test_options_v32_cannot_train_exactly_are_refused(option, match):
    sections = {"model": {"preset": "tiny-v32"}, "train": {"micro_batch_size": 2, "global_batch_size": 8}}
    zero = option.get("zero_optimization", {"stage": 1})  # the DeepSpeed JSON's section; the others the run's
    for key, values in option.items():
        if key == "zero_optimization":
            continue
        sections[key] = {**sections.get(key, {}), **values}
    message = refused(run_config_from_dict(sections), {"zero_optimization": zero}, 2, match)
    assert next(line for line in message.splitlines() if re.search(match, line)).startswith("  - ")


# ----------------------------------------------------------------------------------------------- trainable indexer
# Weights 5x tiny-v32's: attention and indexer scores far from uniform, so that the KL is far from 0.
PEAKED = {"initializer_range": 0.1}


def _trainable(stage: str, seed: int = 7, chunk_elements: int | None = None):
    """tiny-v32 (PEAKED) built from `seed` with its indexers trainable at `stage`, and IndexerLoss hooks on it."""
    config = prepare_config(build_model_config("tiny-v32", None, PEAKED), "sdpa")
    model = build_model(config, 1, seed=seed).train()
    assert train_indexers(model, stage) == config.num_hidden_layers
    if chunk_elements:
        for m in model.modules():
            if isinstance(m, TrainableIndexer):
                m.chunk_elements = chunk_elements
    return model, config, IndexerLoss(model, 1.0, config.num_hidden_layers, torch.device("cpu"))


def _batch(config, rows: int = 2):
    ids = torch.randint(0, config.vocab_size, (rows, 64), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[0, :9] = -100  # a prompt: its queries count in neither loss
    return ids, labels


def test_trainable_indexer_selects_as_transformers_and_its_warmup_is_dense():
    """The trainable indexer's chosen keys are transformers' (sparse: the frozen model's logits, bitwise); in warm-up
    attention keeps every causal key (the logits of tiny-v32 with index_topk = the sequence, bitwise)."""
    ids, _ = _batch(prepare_config(build_model_config("tiny-v32"), "sdpa"))
    frozen = build_model(prepare_config(build_model_config("tiny-v32", None, PEAKED), "sdpa"), 1, seed=7)
    dense = build_model(prepare_config(build_model_config("tiny-v32", None, {**PEAKED, "index_topk": 64}), "sdpa"), 1,
                        seed=7)
    for stage, expected in (("sparse", frozen), ("warmup", dense)):
        model, _, hooks = _trainable(stage, chunk_elements=4096)  # several query blocks
        hooks.set_global_tokens(torch.tensor(ids.numel()), 1)
        with torch.no_grad():
            assert torch.equal(model(ids), expected(ids)), stage
            assert torch.equal(model.eval()(ids), expected.eval()(ids)), stage  # evaluation selects alike


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_indexer_loss_and_its_gradient_equal_the_definition(stage):
    """Our indexer loss (blocks of 16 queries, IndexerLoss's global mean over the counted queries and layers) and the
    gradient it gives the indexers equal the whole-tensor reference (tests/reference_indexer.py) on transformers'
    model; the LM loss equals transformers' (dense in warm-up)."""
    model, config, hooks = _trainable(stage, chunk_elements=2 * 16 * 64)
    ids, labels = _batch(config)
    hooks.set_global_tokens((labels != -100).sum(), 1)
    inputs, _ = split_micro_batch((ids, labels), query_mask=True)
    logits = model(inputs)
    lm = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    (0.0 * lm).backward()  # only the indexer loss's gradient, which IndexerLoss adds
    ours = hooks.take().item()

    dense = {"index_topk": 64} if stage == "warmup" else {}
    ref_config = prepare_config(build_model_config("tiny-v32", None, {**PEAKED, **dense}), "eager")
    hf = v32.DeepseekV32ForCausalLM(ref_config)
    hf.load_state_dict({k: v.detach() for k, v in hf_state_dict(local_layers(model)).items()}, strict=False)
    ref_lm, ref_loss = indexer_loss_reference(hf, ids, labels, sparse=stage == "sparse")
    ref_loss.backward()
    assert ours > 1e-3 and ours == pytest.approx(ref_loss.item(), rel=1e-5)
    assert lm.item() == pytest.approx(ref_lm, rel=1e-5)
    ours_params = hf_state_dict(local_layers(model), keep_vars=True)
    indexers = [n for n, _ in hf.named_parameters() if ".indexer." in n]
    for name in indexers:
        want, got = hf.get_parameter(name).grad, ours_params[name].grad
        assert want.abs().max() > 0, name
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_the_two_losses_train_apart_in_the_sparse_stage():
    """sparse: the LM loss gives the indexers no gradient; the indexer loss gives nothing else one."""
    model, config, hooks = _trainable("sparse")
    ids, labels = _batch(config)
    inputs, _ = split_micro_batch((ids, labels), query_mask=True)
    hooks.set_global_tokens((labels != -100).sum(), 1)
    F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100).mul(0.0).backward()
    params = dict(model.named_parameters())
    indexer = {n for n in params if ".indexer." in n}
    assert indexer and all(params[n].grad.abs().max() > 0 for n in indexer)
    assert all(p.grad is None or not p.grad.any() for n, p in params.items() if n not in indexer)

    model, config, _ = _trainable("sparse")
    for m in model.modules():  # the LM loss alone: no hook adds the indexer loss
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    params = dict(model.named_parameters())
    assert all(params[n].grad is None for n in indexer)
    assert sum(p.grad is not None and bool(p.grad.any()) for n, p in params.items() if n not in indexer) > 20
