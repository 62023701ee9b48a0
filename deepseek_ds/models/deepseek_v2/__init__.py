"""DeepSeek-V2 (and V2-Lite): MLA attention, softmax routing, DeepSeekMoE. Its MLA pieces are V3's too."""

from transformers import DeepseekV2Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2

from ..family import Family, Preset

TINY_MLA = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
    v_head_dim=32, qk_nope_head_dim=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    first_k_dense_replace=1, max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
)
# transformers' names of the projections LoRA adapts by default: MLA's (q_proj where a model has no q_lora_rank, as
# V2-Lite); its MLP projections cannot be targets (see lora.MLP_NAMES); the routed experts are adapted through
# lora.routed_experts.
MLA_LORA_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# MLA, split by heads: the up-projections from the latents are column-parallel (q_proj without q_lora_rank, as
# in V2-Lite), the low-rank down-projections and their norms replicated (they feed every head).
MLA_TP_SPECS = (
    {"patterns": [r".*\.self_attn\.(q_b_proj|kv_b_proj|q_proj)\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"], "partition_type": "skip"},
)

PRESETS = {
    "tiny-v2": Preset(DeepseekV2Config, dict(TINY_MLA, n_group=1, topk_group=1, topk_method="greedy"),
                      "DeepSeek-V2 architecture (MLA, softmax routing, 1 shared + 8 routed experts), ~2.2M params"),
    "deepseek-v2": Preset(DeepseekV2Config, dict(
        vocab_size=102400, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=60,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=2, n_routed_experts=160, routed_scaling_factor=16.0,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=3, topk_method="group_limited_greedy", num_experts_per_tok=6, first_k_dense_replace=1,
        max_position_embeddings=163840, bos_token_id=100000, eos_token_id=100001), "DeepSeek-V2 236B (21B active)"),
    "deepseek-v2-lite": Preset(DeepseekV2Config, dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1,
        topk_group=1, topk_method="greedy", num_experts_per_tok=6, first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
        bos_token_id=100000, eos_token_id=100001), "DeepSeek-V2-Lite 16B (2.4B active)"),
}

FAMILY = Family(
    "deepseek_v2", DeepseekV2Config, v2.DeepseekV2ForCausalLM, v2.DeepseekV2DecoderLayer, v2.DeepseekV2RMSNorm,
    v2.DeepseekV2RotaryEmbedding, PRESETS, MLA_LORA_TARGETS, MLA_TP_SPECS,
    # DeepSeek-V2 paper sec. 3.1.2. Its routers have no correction bias; its device-level loss needs device groups.
    moe_defaults={"bias_update_speed": 0.0, "seq_aux_alpha": 3e-3, "device_aux_alpha": 0.05, "comm_aux_alpha": 0.02},
    score_func="softmax",
)
