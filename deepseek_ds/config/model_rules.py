"""The model's rules of validate(): its path or preset with overrides against the layout, the sequence length, the
family's own refusals, and the MoE, MTP and LoRA settings."""

from __future__ import annotations

import dataclasses
import os

from ..data import DataError, PromptDataset, dataset_info
from ..models.hf_io import has_weights, pickled_weights
from ..models.layers import mtp_depth
from ..models.lora import lora_errors, lora_name_errors
from ..models.moe import resolve_settings
from ..models.muon import MLA_MODEL_TYPES, PER_HEAD, per_head
from ..models.pipeline import partition, partition_stages
from ..models.presets import ModelConfigError, first_moe_layer, num_routed_experts
from ..models.registry import family_of
from .deepspeed_json import expert_gradient_path_errors, zero_stage
from .schema import RunConfig


def model_errors(cfg: RunConfig, ds: dict, files: bool = True) -> list[str]:
    """The model (its path, or its preset with overrides) against the layout, the sequence length and the MoE and
    MTP settings."""
    p = cfg.parallel
    if cfg.model.path and not os.path.isdir(cfg.model.path):
        return [f"model.path {cfg.model.path!r} does not exist; point it at a local HF model directory"]
    pickled = pickled_weights(cfg.model.path) if files and cfg.model.path and not has_weights(cfg.model.path) else []
    if pickled:
        return [f"model.path {cfg.model.path!r} holds only PyTorch pickle weights ({pickled[0]}), "
                "which deepseek-ds does not read (training would start from random weights); convert it once with "
                "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)`"]
    try:
        mcfg = cfg.model.hf_config
    except (ModelConfigError, TypeError, ValueError) as e:
        return [str(e)]
    errors = []
    n_layers = mcfg.num_hidden_layers + 3  # + embedding, final norm, head
    stages = partition_stages(p.pipeline_stages, p.pipeline_schedule)
    if stages > n_layers:
        two = " x 2 (dualpipev: two stages per rank)" if stages > p.pipeline_stages else ""
        errors.append(f"parallel.pipeline_stages ({p.pipeline_stages}){two} exceeds the number of pipeline layers "
                      f"({n_layers}: {mcfg.num_hidden_layers} decoder layers + embedding, norm, head)")
    experts = num_routed_experts(mcfg)
    if p.expert_parallel > 1 and not experts:
        errors.append(f"parallel.expert_parallel = {p.expert_parallel} but model {mcfg.model_type} is dense; "
                      "set it to 1")
    elif experts and experts % p.expert_parallel:
        errors.append(f"routed experts ({experts}) are not divisible by parallel.expert_parallel "
                      f"({p.expert_parallel}); choose a divisor of {experts}")
    # A preset trains from scratch, so its positions can simply grow; a checkpoint's RoPE was trained for its length,
    # and reading past it needs RoPE scaling (YaRN, linear) besides the larger limit.
    if cfg.data.seq_len > mcfg.max_position_embeddings and not cfg.model.path:
        errors.append(f"data.seq_len ({cfg.data.seq_len}) exceeds the model's max_position_embeddings "
                      f"({mcfg.max_position_embeddings}): lower data.seq_len, or --set "
                      "model.overrides.max_position_embeddings=N (N >= data.seq_len)")
    elif cfg.data.seq_len > mcfg.max_position_embeddings:
        errors.append(f"data.seq_len ({cfg.data.seq_len}) exceeds the model's max_position_embeddings "
                      f"({mcfg.max_position_embeddings}): lower data.seq_len, or extend the checkpoint's context with "
                      "RoPE scaling: --set model.overrides.rope_parameters=... (e.g. yarn with a factor) and "
                      "model.overrides.max_position_embeddings=N")
    errors += _family_refusals(cfg, mcfg)
    fam = family_of(mcfg)
    if cfg.train.objective == "grpo" and cfg.grpo.router_replay and fam.score_func not in ("sigmoid", "softmax"):
        errors.append(f"grpo.router_replay: {mcfg.model_type} has " + ("no routed experts" if not fam.is_moe else
                      f"{fam.score_func} routers, which router replay does not serve (DeepSeek-V2/V3/V3.2's do)")
                      + "; set grpo.router_replay: false")
    if cfg.train.objective == "grpo" and files:
        errors += _rollout_length_errors(cfg, mcfg)
    if per_head(ds) and mcfg.model_type not in MLA_MODEL_TYPES:
        errors.append(f"optimizer.params.{PER_HEAD} with model {mcfg.model_type}: per-head Muon orthogonalises MLA's "
                      f"per-head projections (models/muon.py), which {mcfg.model_type} does not have; remove it")
    if cfg.indexer.stage != "frozen" and mcfg.model_type != "deepseek_v32":
        errors.append(f"indexer.stage {cfg.indexer.stage}: deepseek-ds trains the lightning indexer of DeepSeek-V3.2 "
                      f"(model_type deepseek_v32), not of {mcfg.model_type}; set indexer.stage: frozen")
    return errors + _moe_errors(cfg, ds, mcfg) + _mtp_errors(cfg, mcfg) + _lora_errors(cfg, ds, mcfg, files)


def _rollout_length_errors(cfg: RunConfig, mcfg) -> list[str]:
    """GRPO's rows are a prompt and its completion: the longest must fit the model's positions."""
    if not cfg.data.path:
        return []  # grpo_rules asks for one
    try:
        longest = max(PromptDataset(cfg.data.path, split, verify_checksums=False).longest()
                      for split in dataset_info(cfg.data.path)["splits"])
    except (DataError, OSError, KeyError):
        return []  # no prompts dataset there: the data rules say so
    limit, completion = mcfg.max_position_embeddings, cfg.grpo.max_completion_length
    if longest + completion <= limit:
        return []
    return [f"grpo.max_completion_length ({completion}) after data.path's longest prompt ({longest} tokens) makes rows "
            f"of {longest + completion} tokens, past the model's max_position_embeddings ({limit}): lower "
            f"grpo.max_completion_length to {max(limit - longest, 0)} or less, or prepare the prompts without the "
            "longest ones"]


def _family_refusals(cfg: RunConfig, mcfg) -> list[str]:
    """What the model family's layers cannot run exactly: attention kernels, parallelism, its own run options."""
    fam, errors = family_of(mcfg), []
    kernels, attn = fam.attention_kernels, cfg.model.attn_implementation
    if kernels is not None and attn not in kernels:
        errors.append(f"model.attn_implementation {attn!r}: {mcfg.model_type} runs on transformers' "
                      f"{' or '.join(kernels)} attention only ({fam.attention_note}); set model.attn_implementation: "
                      f"{kernels[0]}")
    for degree, why in fam.refused_parallelism.items():
        if getattr(cfg.parallel, degree) > 1:
            errors.append(f"parallel.{degree}: {why}; set parallel.{degree}: 1")
    return errors + (fam.run_refusals(cfg, mcfg) if fam.run_refusals else [])


def _lora_errors(cfg: RunConfig, ds: dict, mcfg, files: bool = True) -> list[str]:
    p = cfg.parallel
    return lora_errors(cfg.lora.r, cfg.lora.target_modules, cfg.lora.routed_experts, p.expert_parallel,
                       not files or bool(cfg.model.path and has_weights(cfg.model.path)), mcfg.model_type,
                       bool(num_routed_experts(mcfg)), mtp_depth(mcfg), zero_stage(ds)) + lora_name_errors(cfg.lora, mcfg)


def _mtp_errors(cfg: RunConfig, mcfg) -> list[str]:
    requested = int(getattr(mcfg, "num_nextn_predict_layers", 0) or 0)
    depth = mtp_depth(mcfg)
    if requested < 0:
        return [f"num_nextn_predict_layers = {requested}: the MTP depth must be >= 0 (model.overrides)"]
    if requested and not depth:
        return [f"num_nextn_predict_layers = {requested}: deepseek-ds trains multi-token prediction for DeepSeek-V3 "
                f"(model_type deepseek_v3) only; transformers builds no MTP module for {mcfg.model_type}, so its MTP "
                "weights would be neither trained nor exported; set model.overrides.num_nextn_predict_layers: 0"]
    if depth and cfg.train.objective == "dpo":  # the preference loss reads the main head only: MTP would not train
        return [f"train.objective: dpo trains no MTP module (the model has {depth}): set "
                "model.overrides.num_nextn_predict_layers: 0"]
    if depth and cfg.train.mtp_loss_weight == 0:
        return [f"train.mtp_loss_weight = 0 leaves the model's {depth} MTP module(s) untrained; give it a weight "
                "(DeepSeek-V3 used 0.3, then 0.1) or set model.overrides.num_nextn_predict_layers: 0"]
    return []


def _moe_errors(cfg: RunConfig, ds: dict, mcfg) -> list[str]:
    """Load-balancing settings that the model cannot use, and expert parallelism set in the wrong place."""
    settings = resolve_settings(cfg.moe, mcfg)
    if settings is None:
        return [f"moe.{k} = {v} but model {mcfg.model_type} is dense (no routed experts); remove it"
                for k, v in dataclasses.asdict(cfg.moe).items() if v]
    errors = []
    if settings.bias_update_speed > 0 and not family_of(mcfg).has_router_bias:
        errors.append(f"moe.bias_update_speed = {settings.bias_update_speed}: {mcfg.model_type} routers have no "
                      "e_score_correction_bias (only DeepSeek-V3's do); set it to 0")
    for key in ("device_aux_alpha", "comm_aux_alpha"):
        if getattr(settings, key) > 0 and settings.device_groups == 1:
            errors.append(f"moe.{key} = {getattr(settings, key)} needs device groups, but the model's n_group is 1 "
                          "(one group: the loss is a constant); set it to 0 or model.overrides.n_group")
    if "expert_parallel" in ds:
        errors.append("deepspeed_config has an 'expert_parallel' section: set parallel.expert_parallel in the run "
                      "YAML instead (deepseek-ds writes the AutoEP section for the model)")
    if cfg.parallel.expert_parallel > 1 and cfg.parallel.pipeline_stages > 1:
        errors += _stages_without_experts(cfg, mcfg)
    if cfg.parallel.expert_parallel > 1 and zero_stage(ds) in (1, 2):
        errors += expert_gradient_path_errors(ds)
    return errors


def _stages_without_experts(cfg: RunConfig, mcfg) -> list[str]:
    """AutoEP refuses a pipeline stage that holds no MoE layer (it finds nothing to replace)."""
    p = cfg.parallel
    try:
        parts = partition(mcfg, partition_stages(p.pipeline_stages, p.pipeline_schedule), cfg.model.partition_method,
                          cfg.data.seq_len)
    except ValueError as e:
        return [str(e)]
    held = [set(range(parts[st], parts[st + 1])) for st in range(len(parts) - 1)]
    if len(held) > p.pipeline_stages:  # dualpipev: rank r holds stages r and 2p-1-r
        held = [held[r] | held[2 * p.pipeline_stages - 1 - r] for r in range(p.pipeline_stages)]
    # Spec i (embedding at 0) is decoder layer i - 1; MoE from first_k_dense_replace on.
    moe_specs = set(range(first_moe_layer(mcfg) + 1, mcfg.num_hidden_layers + 1))
    empty = [rank for rank, specs in enumerate(held) if not moe_specs & specs]
    if not empty:
        return []
    return [f"parallel.expert_parallel = {p.expert_parallel} needs an MoE layer on every pipeline stage, "
            f"but stage(s) {empty} of partition {parts} hold none; change model.partition_method (e.g. "
            "counts:a,b,...) or parallel.pipeline_stages"]
