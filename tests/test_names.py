"""models/names.py: every tensor of every preset's layers has an HF name (or is one checkpoints do not store), the
names are transformers' own, and the per-expert split and the fusion invert each other."""

from __future__ import annotations

import pytest
import torch

from deepseek_ds.models.names import fuse_experts, hf_state_dict, per_expert_names, split_experts
from deepseek_ds.models.pipeline import layer_specs, prepare_config
from deepseek_ds.models.presets import build_model_config
from deepseek_ds.models.registry import family_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2", "tiny-dense", "tiny-qwen2"])
def test_every_layer_tensor_has_transformers_name(preset):
    config = prepare_config(build_model_config(preset))
    with torch.device("meta"):
        layers = [spec.build() for spec in layer_specs(config, seed=None)]
        model = family_of(config).causal_lm(config)
    ours = set(hf_state_dict(layers))
    theirs = set(model.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        theirs.discard("lm_head.weight")  # the tied head has no tensor of its own
    assert ours == theirs


def test_split_and_fuse_experts_invert_each_other():
    experts, hidden, inter = 3, 4, 5
    gate_up = torch.randn(experts, 2 * inter, hidden)
    down = torch.randn(experts, hidden, inter)
    for name, fused in (("model.layers.1.mlp.experts.gate_up_proj", gate_up),
                        ("model.layers.1.mlp.experts.down_proj", down)):
        parts = split_experts(name, fused)
        assert list(parts) == per_expert_names(name, experts)
        assert torch.equal(fuse_experts(name, list(parts.values()), experts), fused)
    assert split_experts("model.layers.1.mlp.gate.weight", down) == {"model.layers.1.mlp.gate.weight": down}
    assert per_expert_names("model.layers.1.mlp.gate.weight", experts) is None
    assert torch.equal(split_experts("model.layers.1.mlp.experts.gate_up_proj", gate_up)
                       ["model.layers.1.mlp.experts.2.up_proj.weight"], gate_up[2, inter:])
