"""The dense DeepSeek LLM / Coder models: transformers' `llama` layout. Its attention pieces are Qwen2's too."""

from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as llama

from ..family import Family, Preset

# transformers' names of the projections LoRA adapts by default.
DENSE_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Llama and Qwen2 (whose q/k/v biases split with their weights: tensor_parallel.split_dim).
DENSE_TP_SPECS = (
    {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
)

PRESETS = {
    "tiny-dense": Preset(LlamaConfig, dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                           bos_token_id=0, eos_token_id=0),
                         "DeepSeek LLM/Coder architecture (Llama layout), ~1.3M params"),
    "deepseek-llm-7b": Preset(LlamaConfig, dict(
        vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=100000,
        eos_token_id=100001), "DeepSeek LLM 7B (dense)"),
    "deepseek-coder-6.7b": Preset(LlamaConfig, dict(
        vocab_size=32256, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=16384, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "linear", "rope_theta": 100000.0, "factor": 4.0}, bos_token_id=32013,
        eos_token_id=32021), "DeepSeek-Coder 6.7B (dense, Llama layout)"),
}

FAMILY = Family("llama", LlamaConfig, llama.LlamaForCausalLM, llama.LlamaDecoderLayer, llama.LlamaRMSNorm,
                llama.LlamaRotaryEmbedding, PRESETS, DENSE_LORA_TARGETS, DENSE_TP_SPECS)
