"""DeepSeek-R1-Distill-Qwen: Qwen2.5(-Math) models (transformers' `qwen2`: Llama blocks with biases on q/k/v)."""

from transformers import Qwen2Config
from transformers.models.qwen2 import modeling_qwen2 as qwen2

from ..dense import DENSE_LORA_TARGETS, DENSE_TP_SPECS
from ..family import Family, Preset

PRESETS = {
    # Grouped-query attention (2 KV heads for 4 query heads) and untied head, as R1-Distill-Qwen has.
    "tiny-qwen2": Preset(Qwen2Config, dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
                         "DeepSeek-R1-Distill-Qwen architecture (Qwen2: q/k/v biases, GQA), ~1.3M params"),
    "deepseek-r1-distill-qwen-1.5b": Preset(Qwen2Config, dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_sliding_window=False, sliding_window=4096,
        max_window_layers=21, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
        "DeepSeek-R1-Distill-Qwen 1.5B (dense, Qwen2 layout)"),
    "deepseek-r1-distill-qwen-7b": Preset(Qwen2Config, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_sliding_window=False, sliding_window=4096,
        max_window_layers=28, tie_word_embeddings=False, bos_token_id=151646, eos_token_id=151643),
        "DeepSeek-R1-Distill-Qwen 7B (dense, Qwen2 layout)"),
}


def sliding_window_refusal(config, source: str) -> str | None:
    """Qwen2's sliding-window layers (use_sliding_window: true) would need a windowed mask in every stage's
    document_attention, which builds full causal masks only."""
    sliding = [i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind == "sliding_attention"]
    if not sliding:
        return None
    return (f"model: {source} has use_sliding_window true (layers {sliding[0]}-{sliding[-1]} "
            "sliding-window attention), which deepseek-ds does not train; set "
            "model.overrides.use_sliding_window: false (DeepSeek-R1-Distill-Qwen ships false)")


FAMILY = Family("qwen2", Qwen2Config, qwen2.Qwen2ForCausalLM, qwen2.Qwen2DecoderLayer, qwen2.Qwen2RMSNorm,
                qwen2.Qwen2RotaryEmbedding, PRESETS, DENSE_LORA_TARGETS,  # its q/k/v biases stay frozen, as peft leaves a target's bias
                DENSE_TP_SPECS, refusal=sliding_window_refusal)
