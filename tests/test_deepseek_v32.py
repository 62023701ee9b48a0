"""DeepSeek-V3.2 with its lightning indexer frozen (transformers computes it without gradients), in one process: our
pipeline layers compute transformers' DeepseekV32ForCausalLM, the indexer selects (fewer keys than the sequence),
holds no trainable parameter, and what the layers cannot train exactly is refused. (Layouts: test_equivalence.py.)"""

import re

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

from deepseek_ds.config import run_config_from_dict
from deepseek_ds.models.hf_io import hf_state_dict
from deepseek_ds.models.pipeline import build_model, local_layers, prepare_config
from deepseek_ds.models.presets import build_model_config
from helpers import refused

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
    ({"parallel": {"expert_parallel": 2}}, r"AutoEP has no DeepSeek-V3.2 preset.*set parallel.expert_parallel: 1"),
], ids=["flash", "sp", "tp", "ep"])
def test_options_v32_cannot_train_exactly_are_refused(option, match):
    sections = {"model": {"preset": "tiny-v32"}, "train": {"micro_batch_size": 2, "global_batch_size": 8}}
    for key, values in option.items():
        sections[key] = {**sections.get(key, {}), **values}
    message = refused(run_config_from_dict(sections), {"zero_optimization": {"stage": 1}}, 2, match)
    assert next(line for line in message.splitlines() if re.search(match, line)).startswith("  - ")
