"""DeepSeek-V3.2: DeepSeek-V3 plus DeepSeek Sparse Attention, a lightning indexer in every layer that keeps the top
`index_topk` earlier tokens of each query. transformers' `deepseek_v32` modules are the model code; their indexer
runs without gradients: frozen by default, trainable with indexer.stage warmup or sparse (indexer.py)."""

import torch
from torch import nn
from transformers import DeepseekV32Config
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

from ..deepseek_v2 import MLA_LORA_TARGETS, TINY_MLA
from ..deepseek_v3 import PRESETS as V3_PRESETS
from ..family import Family, Preset, cached_on

# tiny-v3's shapes with an indexer that keeps 16 of a 64-token sequence's keys, so that the selection matters.
TINY_V32 = dict(TINY_MLA, n_group=4, topk_group=2, num_nextn_predict_layers=0, index_topk=16, index_n_heads=2,
                index_head_dim=32)

PRESETS = {
    "tiny-v32": Preset(DeepseekV32Config, TINY_V32,
                       "DeepSeek-V3.2 architecture (tiny-v3 with a lightning indexer keeping 16 keys per query), "
                       "~2.2M params"),
    # The published config.json: V3's shapes and the indexer (64 heads of 128, top 2048). Its MTP layer, which
    # transformers does not build, is left out (num_nextn_predict_layers 0).
    "deepseek-v3.2": Preset(DeepseekV32Config, dict(
        {k: v for k, v in V3_PRESETS["deepseek-v3"].fields.items() if k != "num_nextn_predict_layers"},
        index_topk=2048, index_head_dim=128, index_n_heads=64, num_nextn_predict_layers=0),
        "DeepSeek-V3.2 671B (37B active) with DeepSeek Sparse Attention"),
}


def run_refusals(cfg, config) -> list[str]:
    """What a trainable indexer (indexer.stage warmup / sparse) cannot train with, one line each with the fix."""
    stage = cfg.indexer.stage
    if stage == "frozen":
        return []
    errors = []
    if cfg.lora.r:
        errors.append(f"lora.r with indexer.stage {stage}: the indexer trains whole, and "
                      + ("the warm-up trains it alone" if stage == "warmup" else "LoRA would freeze the model it "
                         "learns beside") + "; set lora.r: 0, or indexer.stage: frozen to fine-tune with LoRA")
    if stage == "warmup" and cfg.parallel.expert_parallel > 1:
        errors.append("parallel.expert_parallel with indexer.stage warmup: AutoEP's experts join the optimizer "
                      "trainable whatever the warm-up freezes; set parallel.expert_parallel: 1 (ZeRO-3 partitions "
                      "the experts), or indexer.stage: sparse")
    if cfg.train.objective != "lm":
        errors.append(f"train.objective {cfg.train.objective} with indexer.stage {stage}: the indexer loss is taken "
                      "over the LM objective's tokens; set train.objective: lm, or indexer.stage: frozen")
    return errors


def prepare_layer(module: nn.Module, seed: int | None) -> None:
    """The indexers frozen: transformers computes them under no_grad (no gradient reaches them), so they hold no
    optimizer state and no weight decay moves them."""
    for m in module.modules():
        if isinstance(m, v32.DeepseekV32Indexer):
            m.requires_grad_(False)


def layer_kwargs(config, rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                 input_ids: torch.Tensor | None) -> dict:
    """As DeepseekV32Model passes them: the indexer slices a 4-D causal mask, so one is built even where attention
    alone could skip it; with packed documents (position ids restarting) it is the block-diagonal one."""
    one_document = getattr(position_ids, "_one_document", False)
    mask = cached_on(position_ids, ("causal_4d", hidden.dtype), lambda: create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
        position_ids=None if one_document else position_ids, allow_is_causal_skip=False))
    return {"position_ids": position_ids, "position_embeddings": rotary(hidden, position_ids), "attention_mask": mask}


FAMILY = Family(
    "deepseek_v32", DeepseekV32Config, v32.DeepseekV32ForCausalLM, v32.DeepseekV32DecoderLayer,
    v32.DeepseekV32RMSNorm, v32.DeepseekV32RotaryEmbedding, PRESETS, MLA_LORA_TARGETS, (),
    # DeepSeek-V3's balancing (tech report sec. 4.2): V3.2 keeps V3's MoE.
    moe_defaults={"bias_update_speed": 1e-3, "seq_aux_alpha": 1e-4, "device_aux_alpha": 0.0, "comm_aux_alpha": 0.0},
    score_func="sigmoid", has_router_bias=True, router_group_mask=True,
    override_notes={"index_topk": "the lightning indexer is DeepSeek-V3.2's (and V4's CSA layers')"},
    layer_kwargs=layer_kwargs, prepare_layer=prepare_layer, run_refusals=run_refusals,
    attention_kernels=("sdpa", "eager"), attention_note="its flash path hands the indexer's choice to the FlashMLA kernel",
    refused_parallelism={
        "sequence_parallel": "DeepSeek-V3.2's indexer scores each query against every earlier token of the whole "
                             "sequence",
        "tensor_parallel": "DeepSeek-V3.2's indexer has no tensor-parallel split in deepseek-ds (use ZeRO-3 or "
                           "pipeline stages)"},
    autoep_preset="deepseek_v3",  # V3's MoE blocks, unchanged
)
