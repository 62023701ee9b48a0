"""Models: our pipeline layers against transformers' own models, partitions, meta-device real shapes, HF I/O."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from deepseek_ds.models.hf_io import load_hf_weights, to_hf_model
from deepseek_ds.models.pipeline import (
    SequentialLM,
    build_model,
    layer_costs,
    layer_specs,
    local_layers,
    partition,
    partition_table,
    prepare_config,
)
from deepseek_ds.models.presets import PRESETS, build_model_config
from helpers import cli

pytestmark = pytest.mark.unit

TINY = ["tiny-v3", "tiny-v2", "tiny-dense", "tiny-qwen2"]


def tiny(name, **overrides):
    return prepare_config(build_model_config(name, overrides=overrides))


@pytest.mark.parametrize("name", TINY)
def test_logits_match_transformers(name):
    cfg = tiny(name)
    ours = build_model(cfg, 1, seed=11).eval()
    # An independent transformers model: its own init from the global RNG, then our weights loaded by name.
    theirs = type(to_hf_model(ours.layers, cfg))(cfg).eval()
    missing, unexpected = theirs.load_state_dict(to_hf_model(ours.layers, cfg).state_dict(), strict=True)
    assert not missing and not unexpected
    ids = torch.randint(0, cfg.vocab_size, (3, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids) - theirs(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-5


@pytest.mark.parametrize("name", TINY)
def test_loss_matches_transformers_loss(name):
    from deepseek_ds.models.loss import TokenWeightedLoss

    cfg = tiny(name)
    ours = build_model(cfg, 1, seed=3).eval()
    theirs = to_hf_model(ours.layers, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    labels = ids[:, 1:].clone()
    labels[0, :10] = -100  # ignored positions: the weighting must count only valid tokens
    loss_fn = TokenWeightedLoss()
    loss_fn.set_global_tokens(int((labels != -100).sum()), dp_size=1, grad_accum=1)
    with torch.no_grad():
        mine = loss_fn(ours(ids[:, :-1]), labels)
        ref = theirs.loss_function(logits=theirs(input_ids=ids[:, :-1]).logits, labels=None, shift_labels=labels,
                                   vocab_size=cfg.vocab_size)
    assert mine.item() == pytest.approx(ref.item(), rel=1e-6)


def test_token_weighting_across_micro_batches():
    """Two micro-batches with different numbers of valid tokens: the scaled losses average (as DeepSpeed does)
    to the token mean of the whole batch, not to the mean of the two micro-batch means."""
    from deepseek_ds.models.loss import TokenWeightedLoss

    torch.manual_seed(0)
    logits = torch.randn(2, 8, 50)
    labels = torch.randint(0, 50, (2, 8))
    labels[0, 2:] = -100
    loss_fn = TokenWeightedLoss()
    loss_fn.set_global_tokens(int((labels != -100).sum()), dp_size=1, grad_accum=2)
    averaged = (loss_fn(logits[:1], labels[:1]) + loss_fn(logits[1:], labels[1:])) / 2
    whole = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    assert averaged.item() == pytest.approx(whole.item(), rel=1e-6)


def test_activation_checkpointing_gives_same_gradients():
    cfg = tiny("tiny-v3")
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    grads = []
    for interval in (0, 1):
        model = build_model(cfg, 1, seed=5, activation_checkpoint_interval=interval).train()
        model(ids).float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*grads))


def test_tied_embeddings_use_tied_layer_spec_and_match_transformers():
    from deepspeed.pipe import TiedLayerSpec

    cfg = tiny("tiny-dense", tie_word_embeddings=True)
    specs = layer_specs(cfg, seed=1)
    assert isinstance(specs[0], TiedLayerSpec) and isinstance(specs[-1], TiedLayerSpec)
    ours = build_model(cfg, 1, seed=1).eval()
    theirs = to_hf_model(ours.layers, cfg)
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        assert (ours(ids) - theirs(input_ids=ids).logits).abs().max().item() <= 1e-5


def test_initial_weights_do_not_depend_on_layout():
    """Layer i is seeded by (seed, i): building the specs one by one (as a pipeline stage does) gives the
    same tensors as the whole sequential model."""
    cfg = tiny("tiny-v3")
    whole = build_model(cfg, 1, seed=9)
    one_by_one = [spec.build() for spec in layer_specs(cfg, seed=9)]
    for a, b in zip(whole.layers, one_by_one):
        for (ka, ta), (kb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(ta, tb)


# R1-Distill-Qwen: the model cards' 1.78B and 7.62B (Qwen2.5-Math-1.5B / 7B shapes, untied heads).
@pytest.mark.parametrize("name,published", [("deepseek-v2", 236e9), ("deepseek-v2-lite", 15.7e9),
                                            ("deepseek-llm-7b", 6.9e9), ("deepseek-coder-6.7b", 6.7e9),
                                            ("deepseek-r1-distill-qwen-1.5b", 1.78e9),
                                            ("deepseek-r1-distill-qwen-7b", 7.62e9)])
def test_real_shapes_on_meta_device_match_published_sizes(name, published):
    cfg = prepare_config(build_model_config(name))
    total = sum(c.params for c in layer_costs(cfg))
    assert abs(total - published) / published < 0.02, f"{name}: {total / 1e9:.2f}B vs published {published / 1e9}B"


def test_deepseek_v3_main_model_and_mtp_module_match_published_counts():
    """Published counts, each checked to 0.2%. DeepSeek-V3's tech report (arXiv:2412.19437) and README_WEIGHTS.md
    (deepseek-ai/DeepSeek-V3 on Hugging Face, as first published): the main model (embedding, 61 layers, final
    norm, head) has 671B parameters, 36.6B of them activated per token including the 0.9B head (the embedding is a
    lookup, not counted as active). The same file gives the MTP module 11.5B parameters besides the embedding and
    head it shares: that is its transformer layer (11.507B); its eh_proj and norms add 0.103B, checked exactly.
    Not checked: the model card's 685B, which counts every tensor of the checkpoint (the MTP layer's own copies of
    the embedding and head, the FP8 scales)."""
    from deepseek_ds.models.layers import MTPLayerPipe

    def near(got: float, published: float) -> bool:
        return abs(got - published) / published < 0.002

    main = layer_costs(prepare_config(build_model_config("deepseek-v3", overrides={"num_nextn_predict_layers": 0})))
    total, active = sum(c.params for c in main), sum(c.active_params for c in main)
    assert near(total, 671e9) and near(active, 36.6e9), f"main model {total / 1e9:.3f}B, active {active / 1e9:.3f}B"
    cfg = prepare_config(build_model_config("deepseek-v3"))
    with torch.device("meta"):
        mtp = MTPLayerPipe(cfg, cfg.num_hidden_layers)
    layer = sum(p.numel() for p in mtp.layer.parameters())  # its transformer layer: MLA attention + MoE
    assert near(layer, 11.5e9), f"MTP transformer layer {layer / 1e9:.3f}B"
    # Besides that layer, the module holds eh_proj (2h -> h) and three RMSNorms (enorm, hnorm, the head's norm).
    h = cfg.hidden_size
    assert sum(p.numel() for p in mtp.parameters()) - layer == 2 * h * h + 3 * h


@pytest.mark.parametrize("method", ["balanced", "uniform", "parameters", "type:MoE", "counts:2,2,2,1", "0,2,4,6,7"])
@pytest.mark.parametrize("stages", [4])
def test_every_partition_method_assigns_every_layer(method, stages):
    cfg = tiny("tiny-v3")
    parts = partition(cfg, stages, method)
    n = len(layer_costs(cfg))
    assert parts[0] == 0 and parts[-1] == n and len(parts) == stages + 1
    assert all(a < b for a, b in zip(parts, parts[1:]))


@pytest.mark.parametrize("layers,stages", [(5, 2), (7, 3), (10, 4), (13, 6)])
def test_uneven_layer_counts_never_drop_a_layer(layers, stages):
    cfg = tiny("tiny-v3", num_hidden_layers=layers)
    for method in ("balanced", "uniform", "parameters"):
        parts = partition(cfg, stages, method)
        assert parts[-1] == layers + 3 and sorted(set(parts)) == parts


def test_bad_partition_is_refused():
    cfg = tiny("tiny-v3")
    with pytest.raises(ValueError, match="partition_method"):
        partition(cfg, 2, "0,3,9")
    with pytest.raises(ValueError, match="pipeline_stages"):
        partition(cfg, 9, "uniform")


def test_deepseek_v3_16_stage_balance():
    """The default partition of the 61-layer model keeps every stage within 1.5x of the mean estimated share."""
    cfg = prepare_config(build_model_config("deepseek-v3"))
    parts = partition(cfg, 16)
    table = partition_table(cfg, parts)
    shares = [float(line.split()[-1].rstrip("%")) for line in table.splitlines()[1:]]
    assert len(shares) == 16 and abs(sum(shares) - 100) <= 16 * 0.05 + 1e-9  # each printed share rounded to 0.1%
    assert max(shares) <= 1.5 * (100 / 16)


@pytest.mark.parametrize("name", ["tiny-v3", "tiny-qwen2"])
def test_hf_round_trip_is_bitwise(name, tmp_path):
    cfg = tiny(name)
    src = build_model(cfg, 1, seed=4)
    with torch.no_grad():
        for key, p in src.named_parameters():
            if key.endswith(".bias"):  # Qwen2's q/k/v biases start at 0: give them values a lost bias would drop
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(key))))
    first = tmp_path / "first"
    to_hf_model(src.layers, cfg).save_pretrained(first, max_shard_size="1MB")
    loaded_cfg = prepare_config(build_model_config(path=str(first)))
    model = build_model(loaded_cfg, 1, seed=None)
    load_hf_weights(model.layers, str(first), loaded_cfg)
    second = tmp_path / "second"
    to_hf_model(model.layers, loaded_cfg).save_pretrained(second, max_shard_size="1MB")

    def tensors(d):
        out = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
        return out

    a, b = tensors(first), tensors(second)
    assert len(glob.glob(os.path.join(first, "*.safetensors"))) > 1  # sharded, with an index
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and transformers itself loads what we wrote
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(second)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, model.eval()(ids), atol=1e-5)


def test_stage_local_loading_reads_only_the_stage_tensors(tmp_path):
    cfg = tiny("tiny-v3")
    full = build_model(cfg, 1, seed=4)
    to_hf_model(full.layers, cfg).save_pretrained(tmp_path, max_shard_size="1MB")
    parts = partition(cfg, 2)
    specs = layer_specs(cfg, seed=None)
    total = sum(p.numel() * p.element_size() for p in full.parameters()) + sum(
        b.numel() * b.element_size() for n, b in full.named_buffers() if "e_score" in n)
    read = []
    for stage in range(2):
        stage_layers = [s.build() for s in specs[parts[stage]:parts[stage + 1]]]
        expected = sum(t.numel() * t.element_size() for layer in stage_layers
                       for k, t in layer.state_dict().items() if not k.startswith("rotary."))
        got = load_hf_weights(stage_layers, str(tmp_path), cfg)
        assert got == expected  # exactly this stage's bytes, not the whole model's
        read.append(got)
        for layer, ref in zip(stage_layers, full.layers[parts[stage]:parts[stage + 1]]):
            for (k, t), (_, r) in zip(layer.state_dict().items(), ref.state_dict().items()):
                assert torch.equal(t, r), k
    assert sum(read) == total and max(read) < 0.7 * total


def test_local_layers_of_sequential_model():
    cfg = tiny("tiny-dense")
    model = build_model(cfg, 1, seed=1)
    assert isinstance(model, SequentialLM) and len(local_layers(model)) == cfg.num_hidden_layers + 3


def test_presets_registry_is_complete():
    assert {"tiny-v3", "tiny-v2", "tiny-dense", "tiny-qwen2", "deepseek-v3", "deepseek-v2", "deepseek-v2-lite",
            "deepseek-llm-7b", "deepseek-coder-6.7b", "deepseek-r1-distill-qwen-1.5b",
            "deepseek-r1-distill-qwen-7b"} <= set(PRESETS)


def test_partition_command_refuses_too_many_stages_in_one_line(capsys):
    assert cli(["models", "partition", "--preset", "tiny-v3", "--stages", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepseek-ds: error: parallel.pipeline_stages (100) exceeds") and "Traceback" not in err


# ----------------------------------------------------------------------------------------------- qwen2 (R1-Distill-Qwen)
def test_r1_distill_qwen_flops_are_the_dense_formula():
    """6 x the parameters a token's matmuls touch (all but the embedding lookup) plus, per layer, every query head's
    scores and values over half the causal square: 12 query heads of 128 (1536 / 12) share 2 K/V heads, which
    changes the parameters, not the attention matmuls."""
    from deepseek_ds.models.flops import per_token

    cfg = tiny("deepseek-r1-distill-qwen-1.5b")
    seq = 4096
    total = sum(c.params for c in layer_costs(cfg))
    matmuls = total - 151936 * 1536
    attention = 28 * 6 * 12 * seq * (128 + 128) // 2
    assert per_token(layer_costs(cfg), cfg, seq) == 6 * matmuls + attention


def test_qwen2_qkv_biases_split_with_their_columns():
    """AutoTP splits a column-parallel Linear's bias with its outputs (DeepSpeed's LinearLayer) and keeps a
    row-parallel one's whole: the checkpoint gather, the split loader and plan's per-rank count read split_dim."""
    from deepseek_ds.models.tensor_parallel import split_dim

    cfg = tiny("tiny-qwen2")
    names = [n for n, _ in build_model(cfg, 1, seed=None).named_parameters() if n.startswith("layers.1.")]
    biases = {n.split(".")[-2] for n in names if n.endswith(".bias")}
    assert biases == {"q_proj", "k_proj", "v_proj"}
    for name in names:
        proj = name.split(".")[-2]
        expected = 0 if proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else \
            1 if proj in ("o_proj", "down_proj") and name.endswith(".weight") else None
        assert split_dim(name, "qwen2") == expected, name
    assert split_dim("layers.1.layer.mlp.down_proj.bias", "qwen2") is None  # a row-parallel bias stays whole
    # plan's count of one TP=2 rank: the whole model less half of every projection, biases included (the engine's
    # own count, logged by a TP=2 launch of tiny-qwen2, was 919,168 of 1,312,896).
    from deepseek_ds.plan.params import SpecParams, rank_params

    model = build_model(cfg, 1, seed=None)
    total = sum(p.numel() for p in model.parameters())
    split = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2].endswith("_proj"))
    specs = SpecParams(cfg)
    assert sum(p.numel for p in rank_params(specs, specs.bounds(1, "balanced", 64), 0, 1, 2)) == total - split // 2


def test_qwen2_lora_matches_peft_on_transformers():
    """LoRA on tiny-qwen2 with the family's default targets adapts the modules peft adapts on transformers'
    Qwen2ForCausalLM (the q/k/v biases frozen, as the base weights), and with the same adapters gives its logits and
    adapter gradients."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen2ForCausalLM

    from deepseek_ds.config import load_run_config
    from deepseek_ds.models.lora import apply_lora
    from deepseek_ds.models.names import hf_state_dict

    cfg = tiny("tiny-qwen2")
    run = load_run_config("recipes/tiny-v3.yaml", ["model.preset=tiny-qwen2", "lora.r=4", "lora.alpha=8"])
    ours = build_model(cfg, 1, seed=6)
    base = {k: v.detach().clone() for k, v in hf_state_dict(ours.layers).items()}
    apply_lora(ours, run.lora, cfg, seed=6)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_B." in name:  # B starts at 0: non-zero adapters make the comparison mean something
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    theirs = Qwen2ForCausalLM(cfg)
    theirs.load_state_dict(base, strict=True)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # written out here
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets), theirs)
    adapters = hf_state_dict(ours.layers)
    mine = {n for n, p in adapters.items() if ".lora_" in n}
    trainable = {n for n, p in theirs.named_parameters() if p.requires_grad}
    assert trainable == mine and not any(n.endswith(".bias") for n in trainable)
    assert all(".lora_" in n for n, p in ours.named_parameters() if p.requires_grad)  # biases frozen here too
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(adapters[name] if name in adapters else p)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    a, b = ours.train()(ids), theirs.train()(input_ids=ids).logits
    assert (a - b).abs().max().item() <= 1e-5
    a.float().pow(2).mean().backward()
    b.float().pow(2).mean().backward()
    got = {n: p.grad for n, p in hf_state_dict(ours.layers, keep_vars=True).items() if ".lora_" in n}
    want = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    assert all(torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-7) for n in want)


def test_qwen2_sliding_window_layers_are_refused_in_one_line():
    """Qwen2's sliding-window layers would attend over the whole causal prefix here (document_attention builds full
    masks): refused, naming the field; max_window_layers past the last layer leaves no sliding layer and passes."""
    from deepseek_ds.models.presets import ModelConfigError

    with pytest.raises(ModelConfigError, match=r"use_sliding_window true \(layers 2-3 .*set "
                                               r"model.overrides.use_sliding_window: false"):
        build_model_config("tiny-qwen2", overrides={"use_sliding_window": True, "max_window_layers": 2})
    assert build_model_config("tiny-qwen2", overrides={"use_sliding_window": True, "max_window_layers": 4})
