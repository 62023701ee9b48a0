"""DeepSeek-V4: hybrid compressed attention (sliding window, CSA with a lightning indexer, HCA), manifold-constrained
hyper-connections (`hc_mult` residual streams), hash-routed MoE in the first layers and sqrt-softplus routing with
auxiliary-loss-free balancing in the rest. transformers' `deepseek_v4` modules are the model code; between pipeline
stages travel the streams [B, S, hc_mult, D], the position ids and the input ids (layers.py)."""

from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from ..family import Family, Preset
from .layers import layer_kwargs, prepare_layer

# Every layer kind of V4 in four layers (hash MoE, sliding, CSA and HCA), at sizes where each kind matters within a
# 64-token sequence: a window of 8, CSA entries every 4 tokens of which the indexer keeps 4, HCA entries every 8.
# 8 indexer heads: an entry's score is a sum of ReLUs, exactly 0 for many entries with 2 heads, and top-k breaks
# such ties by position, so the same tokens could select differently in a longer (e.g. right-padded) sequence.
TINY_V4 = dict(
    vocab_size=2048, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=64, partial_rotary_factor=0.5, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=20, sliding_window=8, o_groups=2,
    o_lora_rank=32, index_n_heads=8, index_head_dim=16, index_topk=4, num_nextn_predict_layers=0,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    max_position_embeddings=4096, bos_token_id=0, eos_token_id=0,
)

# V4-Flash's and V4-Pro's shapes as transformers' DeepseekV4Config documents them (no hub here to read the released
# config.json); counted from them, the totals are the published 284B / 13B and 1.6T / 49B (tests/test_plan_v4.py).
_V4_COMMON = dict(
    vocab_size=129280, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, n_shared_experts=1,
    num_experts_per_tok=6, scoring_func="sqrtsoftplus", norm_topk_prob=True, hc_mult=4, hc_sinkhorn_iters=20,
    sliding_window=128, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, swiglu_limit=10.0,
    # The published configs have 1 MTP layer, which transformers does not build and deepseek-ds does not train.
    num_nextn_predict_layers=0, max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    bos_token_id=0, eos_token_id=1,
)


def _interleaved(n: int) -> list[str]:
    """V4's attention schedule: two HCA layers, then CSA and HCA alternating (the config's own default)."""
    return (["heavily_compressed_attention"] * 2
            + ["compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention" for i in range(n - 2)])


PRESETS = {
    "tiny-v4": Preset(DeepseekV4Config, TINY_V4,
                      "DeepSeek-V4 architecture (sliding/CSA/HCA attention, 2 hyper-connection streams, a hash-routed "
                      "and 3 top-k MoE layers of 1 shared + 8 routed experts), ~1.6M params"),
    "deepseek-v4-flash": Preset(DeepseekV4Config, dict(
        _V4_COMMON, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
        n_routed_experts=256, routed_scaling_factor=1.5, o_groups=8, layer_types=_interleaved(43),
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40), "DeepSeek-V4-Flash 284B (13B active)"),
    "deepseek-v4-pro": Preset(DeepseekV4Config, dict(
        _V4_COMMON, hidden_size=7168, moe_intermediate_size=3072, num_hidden_layers=61, num_attention_heads=128,
        q_lora_rank=1536, n_routed_experts=384, routed_scaling_factor=2.5, o_groups=16, layer_types=_interleaved(61),
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 58), "DeepSeek-V4-Pro 1.6T (49B active)"),
}

# LoRA's default targets: the attention's projections, named with their parent (peft matches dotted suffixes) so that
# the compressors' and the frozen indexers' kv_proj / q_b_proj are left as they are. The shared experts' MLP names
# are refused for every DeepSeek family (models/lora.py MLP_NAMES).
V4_LORA_TARGETS = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_b_proj")
# Modules an adapter cannot go on: the grouped output projection (an nn.Linear whose forward peft's LoRA delta does
# not follow) and the frozen indexers (no gradient reaches them).
_NO_ADAPTER = ("o_a_proj", "indexer")


def run_refusals(cfg, config) -> list[str]:
    """The run options V4's layers cannot train exactly besides the kernels and parallelism (FAMILY), one line each
    with the fix: the compressors take their windows and rotary positions from absolute row positions, so a packed
    document would see its neighbours' windows; LoRA cannot go on the grouped output projection or the indexers.
    Its MTP layer is refused with the other families' (config.model_rules: transformers builds no V4 MTP module)."""
    errors = []
    if cfg.data.packing or cfg.data.document_mask:
        errors.append("data.packing / data.document_mask: DeepSeek-V4's compressors take their windows and positions "
                      "from each row's absolute positions, so a packed document would differ from the same document "
                      "alone; set data.packing: false and data.document_mask: false (one sample per sequence)")
    targets = cfg.lora.target_modules if cfg.lora.r else None
    if targets == "all-linear" or any(part in _NO_ADAPTER for t in targets or () for part in t.split(".")):
        errors.append(f"lora.target_modules {targets!r}: DeepSeek-V4's grouped output projection (o_a_proj) and "
                      "frozen lightning indexers cannot take adapters; name the targets (e.g. self_attn.q_b_proj, "
                      "self_attn.o_b_proj) or leave it null for the attention projections")
    return errors


FAMILY = Family(
    "deepseek_v4", DeepseekV4Config, v4.DeepseekV4ForCausalLM, v4.DeepseekV4DecoderLayer, v4.DeepseekV4RMSNorm,
    v4.DeepseekV4RotaryEmbedding, PRESETS, V4_LORA_TARGETS, (),
    # V3's balancing (tech report sec. 2.1.2) on the top-k layers; the hash layers' routing is a fixed table.
    moe_defaults={"bias_update_speed": 1e-3, "seq_aux_alpha": 1e-4, "device_aux_alpha": 0.0, "comm_aux_alpha": 0.0},
    score_func="sqrtsoftplus", has_router_bias=True,
    override_notes={"hc_mult": "hyper-connection streams are DeepSeek-V4's",
                    "layer_types": "compressed attention layers are DeepSeek-V4's"},
    run_refusals=run_refusals, streams_head=v4.DeepseekV4HyperHead, carries_token_ids=True,
    layer_kwargs=layer_kwargs, prepare_layer=prepare_layer, renamed_on_disk=True,
    attention_kernels=("eager",), attention_note="head_dim 512 is past flash attention's limit, SDPA has no sinks",
    refused_parallelism={
        "sequence_parallel": "DeepSeek-V4's compressors need whole, window-aligned sequences on each rank",
        "tensor_parallel": "DeepSeek-V4 has one KV head shared by every query head and whole-sequence compressors, "
                           "nothing tensor parallelism splits exactly (use ZeRO-3 or pipeline stages)",
        "expert_parallel": "DeepSpeed's AutoEP has no DeepSeek-V4 router (hash routing, sqrt-softplus scores, clamped "
                           "SwiGLU experts; ZeRO-3 partitions the experts instead)"},
)
