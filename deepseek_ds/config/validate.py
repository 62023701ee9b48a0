"""validate(): every rule that needs more than one field's value (several sections, the DeepSpeed JSON, the model
architecture, the world size), checked before any process starts. Single-field rules are in schema.py."""

from __future__ import annotations

import dataclasses
import os

import torch
from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

from ..data import DataError, dataset_info
from ..data.blend import blend_errors
from ..data.layout import MASKED_FORMATS, PREFERENCE_FORMAT, TOKENIZER_DIR, dataset_format
from ..data.sft import dataset_option_errors
from ..data.tokenizer import dataset_tokenizer_hashes, describe, directory_tokenizer
from ..models.hf_io import has_weights
from ..models.layers import mtp_depth
from ..models.muon import NS_PRECISION, NS_PRECISIONS, is_muon, ns_precision
from ..models.presets import ModelConfigError, build_model_config, num_routed_experts
from ..models.tensor_parallel import tensor_parallel_errors
from ..models.tiled import tiled_mlp_errors
from ..parallel.degrees import layout_errors
from ..parallel.schedule_rules import pipeline_schedule_errors
from ..parallel.sequence import sequence_parallel_errors
from .deepspeed_json import (
    asynchronous_checkpoint_engines,
    deepspeed_refusals,
    missing_monitor_packages,
    offloads,
    precision,
    resolve_ds_config,
    skips_nonfinite_steps,
    unknown_top_level_keys,
    zero_stage,
)
from .grpo_rules import grpo_errors
from .model_rules import model_errors
from .schema import ConfigError, RunConfig


def validate(cfg: RunConfig, ds: dict, world_size: int, cuda_available: bool | None = None,
             files: bool = True) -> None:
    """Every check that can be made before processes start. Raises ConfigError listing all problems; DeepSpeed's
    own config model runs last, only when these rules pass (its complaints would otherwise restate theirs).
    files=False leaves out the dataset, the eval.task file and model.path's weights (`deepseek-ds plan` checks a
    layout for a cluster from a machine that may hold none of them); model.path's config.json is still read."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    errors = (unknown_top_level_keys(ds) + _layout_errors(cfg, world_size) + _deepspeed_errors(cfg, ds, cuda_available)
              + _pipeline_schedule_errors(cfg, ds, world_size)
              + model_errors(cfg, ds, files) + (_blend_or_data_errors(cfg) if files else []) + _task_errors(cfg, files)
              + _nan_policy_errors(cfg, ds) + missing_monitor_packages(ds)
              + asynchronous_checkpoint_engines(ds) + _tensor_parallel_errors(cfg, ds)
              + _sequence_parallel_errors(cfg) + _muon_errors(cfg, ds) + _indexer_clip_errors(cfg, ds)
              + tiled_mlp_errors(cfg.train.tiled_mlp, cfg.parallel.expert_parallel)
              + _preference_errors(cfg, zero_stage(ds), files) + grpo_errors(cfg, ds, world_size, files))
    if not errors:
        try:
            errors = deepspeed_refusals(resolve_ds_config(ds, cfg, world_size))
        except ConfigError as e:
            errors = [str(e)]
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def _layout_errors(cfg: RunConfig, world_size: int) -> list[str]:
    """The world size against pipeline x tensor x sequence x data parallelism, and the batch arithmetic."""
    return layout_errors(cfg.parallel.degrees, world_size, cfg.train.micro_batch_size, cfg.train.global_batch_size)


def _sequence_parallel_errors(cfg: RunConfig) -> list[str]:
    sp = cfg.parallel.sequence_parallel
    if sp == 1:
        return []
    try:
        mcfg = cfg.model.hf_config
    except (ModelConfigError, TypeError, ValueError):
        return []  # the model's own problem, reported by _model_errors
    return sequence_parallel_errors(
        sp, heads=mcfg.num_attention_heads, kv_heads=getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads,
        seq_len=cfg.data.seq_len, attn_implementation=cfg.model.attn_implementation,
        pipeline_stages=cfg.parallel.pipeline_stages, tensor_parallel=cfg.parallel.tensor_parallel,
        mtp_depth=mtp_depth(mcfg), objective=cfg.train.objective, compile=cfg.train.compile)


def _tensor_parallel_errors(cfg: RunConfig, ds: dict) -> list[str]:
    """parallel.tensor_parallel against the ZeRO stage, other parallelism and the model's head / MLP sizes."""
    tp = cfg.parallel.tensor_parallel
    errors = ["deepspeed_config has a 'tensor_parallel' section: set parallel.tensor_parallel in the run YAML "
              "instead (deepseek-ds writes the AutoTP section for the model)"] if "tensor_parallel" in ds else []
    if tp == 1:
        return errors
    try:
        mcfg = cfg.model.hf_config
    except (ModelConfigError, TypeError, ValueError):
        return errors  # the model's own problem, reported by _model_errors
    sizes = {"intermediate_size": mcfg.intermediate_size}
    if num_routed_experts(mcfg):
        sizes["moe_intermediate_size x n_shared_experts"] = mcfg.moe_intermediate_size * mcfg.n_shared_experts
    return errors + tensor_parallel_errors(
        tp, pipeline_stages=cfg.parallel.pipeline_stages, expert_parallel=cfg.parallel.expert_parallel,
        zero_stage=zero_stage(ds), heads=mcfg.num_attention_heads,
        kv_heads=getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads, intermediate_sizes=sizes,
        lora=cfg.lora.r > 0, mtp_depth=mtp_depth(mcfg))


def _deepspeed_errors(cfg: RunConfig, ds: dict, cuda_available: bool) -> list[str]:
    """ZeRO stage and precision against pipelines and the hardware."""
    stage, prec, stages = zero_stage(ds), precision(ds), cfg.parallel.pipeline_stages
    errors = []
    if stage not in (0, 1, 2, 3):
        errors.append(f"deepspeed_config zero_optimization.stage = {stage}: must be 0, 1, 2 or 3")
    if stages > 1 and stage >= 2:
        errors.append(f"pipeline parallelism (parallel.pipeline_stages={stages}) cannot be combined "
                      f"with ZeRO stage {stage} (DeepSpeed supports only ZeRO 0/1 with pipelines); use "
                      "ds_configs/zero1_pp.json or set parallel.pipeline_stages=1")
    if prec == "fp16" and not cuda_available:
        errors.append("fp16 needs a CUDA GPU (DeepSpeed's CPU accelerator refuses it); on CPU use a bf16 config "
                      "such as ds_configs/zero1_bf16.json or an fp32 one")
    if prec == "bf16" and stage == 0:
        errors.append("bf16 with ZeRO stage 0 goes through DeepSpeed's FP16_Optimizer and its losses drift from "
                      "the ZeRO path; use ZeRO >= 1 for bf16 (e.g. ds_configs/zero1_bf16.json)")
    if "loss_scale" in ds.get("bf16", {}):
        errors.append("deepspeed_config bf16.loss_scale is not a DeepSpeed field (bf16 needs no loss scaling); "
                      "remove it")
    return errors


def _pipeline_schedule_errors(cfg: RunConfig, ds: dict, world_size: int) -> list[str]:
    p = cfg.parallel
    if world_size % p.degrees.model_parallel:
        return []  # no whole number of replicas: _layout_errors says so
    return pipeline_schedule_errors(p.pipeline_schedule, p.pipeline_stages, cfg.grad_accum_steps(p.degrees.data(world_size)),
                                    zero_stage(ds), precision(ds))


def _gradient_clipping(cfg: RunConfig, ds: dict) -> float:
    """The clipping norm the engine will use (0: none)."""
    clip = ds.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    return (cfg.train.grad_clip if clip == "auto" else clip) or 0


def _indexer_clip_errors(cfg: RunConfig, ds: dict) -> list[str]:
    """indexer.stage sparse clips the LM's and the indexers' gradients apart (training/clip_groups.py), inside ZeRO
    1-3's optimizers."""
    if cfg.indexer.stage != "sparse" or not _gradient_clipping(cfg, ds):
        return []
    where = ("ZeRO stage 0" if zero_stage(ds) == 0 else "zero_optimization.offload_optimizer"
             if offloads(ds, "optimizer") else None)
    return [f"indexer.stage sparse with gradient clipping and {where}: the language model and the indexers are "
            "clipped by their own norms inside ZeRO 1-3's optimizers, without offload; use ds_configs/zero1.json (or zero3) "
            "without optimizer offload, or set train.grad_clip=0"] if where else []


def _muon_errors(cfg: RunConfig, ds: dict) -> list[str]:
    """DeepSpeed's Muon (models/muon.py) where it is exact, and refused with the reason where it is not."""
    if not is_muon(ds):
        return []
    errors, stage, zero = [], zero_stage(ds), ds.get("zero_optimization", {})
    if _gradient_clipping(cfg, ds) and cfg.indexer.stage == "sparse":
        errors.append("indexer.stage sparse with gradient clipping and Muon: the indexers are clipped by their own "
                      "norm and Muon's update by the norm of all gradients; use an AdamW config, or set "
                      "train.grad_clip=0")
    if cfg.lora.r:
        errors.append("LoRA with Muon: Muon would orthogonalise each adapter factor on its own, not the update of "
                      "the adapted weight, and no reference checks it; use an AdamW config for LoRA")
    if stage == 0:
        errors.append("Muon with ZeRO stage 0: DeepSpeed's Muon orthogonalises inside its ZeRO optimizers, and "
                      "stage 0 (plain SGD until DeepSpeed #8442) is not checked against a reference here; use "
                      "ds_configs/zero1_muon.json")
    if offloads(ds, "optimizer"):
        errors.append("zero_optimization.offload_optimizer with Muon: DeepSpeed's offloaded step orthogonalises "
                      "before the gradient norm and each fused gate_up_proj as one matrix per expert, not as the "
                      "rule says; remove offload_optimizer")
    if zero.get("compute_grad_norm") is False:
        errors.append("zero_optimization.compute_grad_norm false with Muon: Muon runs after the step's gradient "
                      "norm (models/muon.py); remove compute_grad_norm")
    if cfg.parallel.tensor_parallel > 1:
        errors.append("Muon with tensor parallelism: AutoTP splits each matrix over the TP ranks and Muon would "
                      "orthogonalise every shard on its own, not the whole matrix; set parallel.tensor_parallel=1")
    precision = ns_precision(ds)
    if precision not in NS_PRECISIONS:
        errors.append(f"optimizer.params.{NS_PRECISION} = {precision!r}: choose one of {', '.join(NS_PRECISIONS)} "
                      "(auto: DeepSpeed's choice by device and ns_method; fp32: Newton-Schulz in fp32)")
    if stage == 3 and zero.get("reduce_scatter", True):
        errors.append("Muon with ZeRO stage 3 needs zero_optimization.reduce_scatter false (DeepSpeed refuses the "
                      "two together); see ds_configs/zero3_muon.json")
    return errors


def _blend_or_data_errors(cfg: RunConfig) -> list[str]:
    """data.path's checks, or data.blend's own and then each source's as data.path's."""
    if not cfg.data.blend:
        return _data_errors(cfg)
    errors = blend_errors(cfg.data.blend)
    for source in cfg.data.blend if not errors else ():
        alone = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=source, blend=None))
        errors += [e.replace("data.path ", "data.blend source ") for e in _data_errors(alone)]
    return errors


def _data_errors(cfg: RunConfig) -> list[str]:
    if not cfg.data.path:
        return []
    if not os.path.isdir(cfg.data.path):
        return [f"data.path {cfg.data.path!r} does not exist; prepare one with "
                "`deepseek-ds data prepare --input ... --out DIR` or use data.builtin: stdlib"]
    try:
        info = dataset_info(cfg.data.path)
    except DataError as e:
        return [str(e)]
    options = dataset_option_errors(cfg.data.path, info, cfg.data, ("train", "valid") if cfg.eval.interval else ("train",))
    if dataset_format(info) in MASKED_FORMATS:
        # Chat samples need not fill a sequence (they are padded): one held-out conversation is enough.
        held_out = info["splits"].get("valid", {}).get("num_docs", 0)
        chat = [f"eval.interval is {cfg.eval.interval} but the validation split of {cfg.data.path!r} holds no "
                "conversation: prepare it with a --valid-fraction > 0, or set eval.interval: 0"
                ] if cfg.eval.interval and not held_out else []
        return options + chat + _vocab_errors(cfg, info)
    splits = info["splits"]
    # A split of n tokens holds (n - 1) // seq_len samples (each needs seq_len + 1 tokens for its labels).
    need = cfg.data.seq_len + 1
    errors = []
    if splits["train"]["num_tokens"] < need:
        errors.append(f"data.path {cfg.data.path!r}: the train split has {splits['train']['num_tokens']} tokens, "
                      f"fewer than one sample of data.seq_len {cfg.data.seq_len} + 1; prepare more text or lower "
                      "data.seq_len")
    if cfg.eval.interval and splits["valid"]["num_tokens"] < need:
        errors.append(f"eval.interval is {cfg.eval.interval} but the validation split of {cfg.data.path!r} has "
                      f"{splits['valid']['num_docs']} documents / {splits['valid']['num_tokens']} tokens, fewer "
                      f"than one sample of data.seq_len {cfg.data.seq_len} + 1; prepare it with a larger "
                      "--valid-fraction (or more documents), or set eval.interval: 0")
    return options + errors + _vocab_errors(cfg, info)


# The architecture fields a reference model must share with the policy (its log-probabilities are of the same
# tokens through a model of the same shape, built and laid out as the policy is).
_REFERENCE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
                     "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "first_k_dense_replace")


def _preference_errors(cfg: RunConfig, stage: int, files: bool = True) -> list[str]:
    """train.objective against the dataset's format, what dpo does not support yet, and preference.reference."""
    dpo, p, errors = cfg.train.objective == "dpo", cfg.preference, []
    if files and cfg.data.path and os.path.isfile(os.path.join(cfg.data.path, "meta.json")):
        try:
            preference_data = dataset_format(dataset_info(cfg.data.path)) == PREFERENCE_FORMAT
        except DataError:
            preference_data = dpo  # the dataset's own problem, reported by _data_errors
        if dpo and not preference_data:
            errors.append(f"train.objective is dpo but data.path {cfg.data.path!r} is not a preference dataset: prepare "
                          "one with `deepseek-ds data prepare --format preference` or set train.objective: lm")
        elif preference_data and not dpo:
            errors.append(f"data.path {cfg.data.path!r} is a preference dataset (chosen/rejected pairs): set "
                          "train.objective: dpo, or prepare the data with --format chat for next-token training")
    elif dpo and not cfg.data.path:
        errors.append("train.objective dpo needs data.path: a dataset from `deepseek-ds data prepare --format "
                      "preference` (the built-in corpus is raw text)")
    if not dpo:
        return errors
    if cfg.data.packing:
        # Packing pairs would need each sequence's own log-probability out of a packed row; pairs are short next to
        # seq_len only in toy data, so it is left out rather than built.
        errors.append("train.objective dpo does not support data.packing: set data.packing: false (each pair's two "
                      "sequences are padded to data.seq_len)")
    if p.reference and cfg.lora.r:
        errors.append(f"preference.reference {p.reference!r} with LoRA: the reference is the base model with the "
                      "adapters off (no pass, no second model); remove preference.reference")
    split = cfg.parallel.expert_parallel > 1 or cfg.parallel.tensor_parallel > 1
    if p.reference and split and stage == 3:
        # The reference is read into the experts and shards of each rank (checkpoint.tensor_names), which ZeRO-3's
        # partitions of them would need gathered group by group.
        errors.append(f"preference.reference {p.reference!r} with parallel.expert_parallel or tensor_parallel > 1 and "
                      "ZeRO-3 is not supported yet: use ZeRO stage 1 or 2, or preference.reference: null (the "
                      "starting weights)")
    if p.reference and p.loss == "simpo":
        errors.append(f"preference.reference {p.reference!r} is unused: simpo is reference-free; remove it or use "
                      "preference.loss sigmoid or ipo")
    elif p.reference and files:
        errors += _reference_errors(cfg)
    return errors


def _reference_errors(cfg: RunConfig) -> list[str]:
    ref = cfg.preference.reference
    if not os.path.isdir(ref) or not has_weights(ref):
        return [f"preference.reference {ref!r} is not an HF model directory with safetensors weights: point it at "
                "one (e.g. an `deepseek-ds export hf` of the SFT model), or set it to null for the starting weights"]
    try:
        theirs = build_model_config(None, ref, {})
        ours = cfg.model.hf_config
    except (ModelConfigError, TypeError, ValueError) as e:
        return [f"preference.reference {ref!r}: {e}"]
    differ = [f"{k} {getattr(theirs, k, None)} vs {getattr(ours, k, None)}" for k in _REFERENCE_FIELDS
              if getattr(theirs, k, None) != getattr(ours, k, None)]
    if differ:
        return [f"preference.reference {ref!r} is another architecture or vocabulary than the policy's "
                f"({'; '.join(differ)}): use a reference of the policy's own architecture and tokenizer"]
    return []


def _task_errors(cfg: RunConfig, files: bool = True) -> list[str]:
    """eval.task that could never be scored: generation needs the whole model on one rank, and an evaluation to run."""
    e, p = cfg.eval, cfg.parallel
    if not e.task:
        return []
    errors = []
    if p.pipeline_stages > 1 or p.expert_parallel > 1 or p.tensor_parallel > 1:
        errors.append(f"eval.task needs the whole model on every rank for generation, but parallel.pipeline_stages = "
                      f"{p.pipeline_stages}, parallel.expert_parallel = {p.expert_parallel} and "
                      f"parallel.tensor_parallel = {p.tensor_parallel}; set all three to 1, or remove eval.task and "
                      "score checkpoints with `deepseek-ds eval --task`")
    if not e.interval:
        errors.append(f"eval.task {e.task!r} is never scored with eval.interval 0; set eval.interval to N > 0 steps")
    if files and not os.path.isfile(e.task):
        errors.append(f"eval.task {e.task!r} does not exist; point it at a JSON Lines task file (e.g. one from "
                      "`deepseek-ds data synth-task`)")
    return errors


def _vocab_errors(cfg: RunConfig, info: dict) -> list[str]:
    """A dataset tokenized with another tokenizer than the one model.path ships (its embeddings mean that one's ids;
    compared by what decides the ids, whatever the sizes); else, for a preset or a model directory without a
    tokenizer, token ids that reach past the model's embedding (they would fail in the first step on every rank)."""
    if cfg.model.path and os.path.isdir(cfg.model.path):
        try:
            base = directory_tokenizer(cfg.model.path)
        except DataError as e:
            return [f"model.path {cfg.model.path!r}: {e}"]
        if base is not None:
            return [] if base[1] in dataset_tokenizer_hashes(cfg.data.path) else [_other_tokenizer(cfg, info, *base)]
    try:
        vocab = cfg.model.hf_config.vocab_size
    except (ModelConfigError, TypeError, ValueError):
        return []  # the model's own problem, reported by _model_errors
    if info["vocab_size"] <= vocab:
        return []
    return [f"data.path {cfg.data.path!r} was tokenized with {info['vocab_size']} tokens but the model's vocab_size is "
            f"{vocab}; use a dataset prepared with the model's tokenizer or set model.overrides.vocab_size: "
            f"{info['vocab_size']}"]


def _other_tokenizer(cfg: RunConfig, info: dict, base, base_hash: str) -> str:
    ours = f"{cfg.data.path}/{TOKENIZER_DIR} ({info['vocab_size']:,} tokens, hash {info['tokenizer_hash'][:12]})"
    return (f"data.path {cfg.data.path!r} was tokenized with another tokenizer, {ours}, than model.path's, "
            f"{describe(base, cfg.model.path, base_hash)}: the base model's embeddings belong to its own token ids; "
            f"prepare the data with the model's tokenizer (`deepseek-ds data prepare --tokenizer {cfg.model.path} "
            "...`)")


def _nan_policy_errors(cfg: RunConfig, ds: dict) -> list[str]:
    if cfg.train.nan_policy == "skip" and not skips_nonfinite_steps(ds):
        return [f"train.nan_policy = 'skip' needs DeepSpeed to discard steps with non-finite gradients, which "
                f"ZeRO stage {zero_stage(ds)} in {precision(ds)} does not do (the update would be applied); use "
                "ZeRO >= 1 (e.g. ds_configs/zero1.json) or train.nan_policy: stop"]
    return []
