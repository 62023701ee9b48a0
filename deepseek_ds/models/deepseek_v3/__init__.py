"""DeepSeek-V3: V2's MLA, sigmoid group-limited routing with auxiliary-loss-free balancing, multi-token prediction."""

from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from ..deepseek_v2 import MLA_LORA_TARGETS, MLA_TP_SPECS, TINY_MLA
from ..family import Family, Preset

PRESETS = {
    "tiny-v3": Preset(DeepseekV3Config, dict(TINY_MLA, n_group=4, topk_group=2, num_nextn_predict_layers=0),
                      "DeepSeek-V3 architecture (MLA, sigmoid group-limited routing, 1 shared + 8 routed experts), ~2.2M params"),
    "deepseek-v3": Preset(DeepseekV3Config, dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=0, eos_token_id=1), "DeepSeek-V3 671B (37B active)"),
}

FAMILY = Family(
    "deepseek_v3", DeepseekV3Config, v3.DeepseekV3ForCausalLM, v3.DeepseekV3DecoderLayer, v3.DeepseekV3RMSNorm,
    v3.DeepseekV3RotaryEmbedding, PRESETS, MLA_LORA_TARGETS, MLA_TP_SPECS,
    # DeepSeek-V3 tech report sec. 4.2.
    moe_defaults={"bias_update_speed": 1e-3, "seq_aux_alpha": 1e-4, "device_aux_alpha": 0.0, "comm_aux_alpha": 0.0},
    score_func="sigmoid", has_router_bias=True, router_group_mask=True, has_mtp=True,
    override_notes={"num_nextn_predict_layers": "multi-token prediction is DeepSeek-V3's"},
)
