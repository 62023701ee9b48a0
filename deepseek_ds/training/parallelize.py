"""The model of one rank, split and wrapped: parallelize applies, in this order, the pipeline's stages (or ZeRO-3's
partitioned build), the weights of this rank's layers, what trains (the indexer's stage, LoRA), expert, tensor and
sequence parallelism with LoRA on AutoEP's experts, and the DeepSpeed engine that applies ZeRO and the optimizer."""

from __future__ import annotations

import contextlib
import logging

import deepspeed
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from transformers import PretrainedConfig

from ..config import RunConfig, zero_stage
from ..models.deepseek_v32.indexer import train_indexers
from ..models.hf_io import has_weights, load_hf_weights, mtp_layers_absent
from ..models.lora import apply_lora
from ..models.moe import autoep_section, restore_fp32_biases, snapshot_biases
from ..models.muon import deepspeed_muon_config, muon_context
from ..models.names import hf_layer_prefix
from ..models.pipeline import (
    build_model,
    compile_layers,
    defer_logits,
    local_layers,
    partition,
    partition_stages,
    partition_table,
)
from ..models.tensor_parallel import shard_elements, sum_rope_key_grads
from ..models.tiled import tile_mlps
from ..parallel import expert_lora, sequence
from ..parallel.layout import RankLayout
from ..parallel.zero_bubble import ZeroBubbleEngine
from ..utils.private_optimizer import keep_fp32_clip_norm
from ..utils.redact import redact
from .clip_groups import clipped_apart, indexer_parameter_groups
from .process import apply_timeout_to_all_groups


def parallelize(cfg: RunConfig, ds: dict, layout: RankLayout, loss_fn,
                log: logging.Logger) -> tuple[DeepSpeedEngine, dict]:
    """This rank's engine, and the DeepSpeed config it was built with (AutoEP's section added, the batch as DeepSpeed
    counts it under sequence parallelism)."""
    mcfg = cfg.model.hf_config
    model = _build(cfg, ds, mcfg, layout, loss_fn, log)  # pipeline stages, or ZeRO-3 partitioned as built
    _load_weights(cfg, model, mcfg, log)
    if cfg.indexer.stage != "frozen":  # before the engine: its optimizer takes what requires gradients
        log.info("indexer.stage %s: %d lightning indexers train%s", cfg.indexer.stage,
                 train_indexers(model, cfg.indexer.stage), ", nothing else" if cfg.indexer.stage == "warmup" else "")
    if cfg.lora.r:  # adapters on the loaded base; only they (and lora.modules_to_save) reach the optimizer below
        trainable = apply_lora(model, cfg.lora, mcfg, cfg.train.seed)
        log.info("LoRA r=%d: %d trainable parameters on this rank", cfg.lora.r, trainable)
    if cfg.train.tiled_mlp:
        log.info("train.tiled_mlp: %d MLPs compute in tiles of %d tokens", tile_mlps(model, cfg.train.tiled_mlp),
                 cfg.train.tiled_mlp)
    ds = _expert_tensor_sequence(cfg, ds, model, mcfg, layout, log)
    engine = _engine(cfg, ds, model, layout, log, mcfg.num_attention_heads)  # ZeRO, AutoEP, AutoTP, the optimizer
    if layout.sequence_shard:  # before the balancer's hooks
        sequence.keep_mtp_to_real_tokens(engine.module)
    return engine, ds


def _build(cfg: RunConfig, ds: dict, mcfg: PretrainedConfig, layout: RankLayout, loss_fn, log: logging.Logger):
    torch.manual_seed(cfg.train.seed)
    pp, schedule = cfg.parallel.pipeline_stages, cfg.parallel.pipeline_schedule
    if pp > 1:
        parts = partition(mcfg, partition_stages(pp, schedule), cfg.model.partition_method, cfg.data.seq_len)
        if layout.rank == 0:
            log.info("pipeline partition (%s%s):\n%s", cfg.model.partition_method,
                     f"; dualpipev: rank r holds stages r and {2 * pp - 1}-r" if schedule == "dualpipev" else "",
                     partition_table(mcfg, parts, cfg.data.seq_len))
        model = build_model(mcfg, pp, cfg.train.seed, parts=parts, topology=layout.topology,
                            activation_checkpoint_interval=cfg.model.activation_checkpoint_interval, loss_fn=loss_fn,
                            schedule=schedule)
    else:
        # ZeRO-3: each layer is partitioned over the ranks as it is built, so no rank holds the whole model at start.
        # Not with AutoEP, which rebuilds the experts of an ordinary model. LoRA's adapters, injected after the load,
        # are partitioned by deepspeed.initialize.
        zero_init = zero_stage(ds) == 3 and cfg.parallel.expert_parallel == 1
        with deepspeed.zero.Init(config_dict_or_path=_deepspeed_view(ds, layout), mpu=layout.tensor_groups,
                                 enabled=zero_init):
            model = build_model(mcfg, 1, cfg.train.seed,
                                activation_checkpoint_interval=cfg.model.activation_checkpoint_interval)
        if zero_init:
            params = list(model.parameters())
            log.info("ZeRO-3: built partitioned (deepspeed.zero.Init): this rank holds %d of %d parameter elements",
                     sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params))
    layout.bind(model)
    if zero_stage(ds) < 3:  # the chunked loss; ZeRO-3 gathers the head's weight only inside the head's own module
        defer_logits(model)
    if cfg.train.compile:
        log.info("train.compile: %d decoder layers compiled (torch.compile, each layer a region)", compile_layers(model))
    return model


def _load_weights(cfg: RunConfig, model, mcfg: PretrainedConfig, log: logging.Logger) -> None:
    if not (cfg.model.path and has_weights(cfg.model.path)):
        return
    layers, absent = mtp_layers_absent(local_layers(model), cfg.model.path)
    for layer in absent:  # adding MTP to a model trained without it (transformers' V3 config defaults to depth 1)
        log.info("%s has no MTP module %d (%s*): it starts from its seeded initialisation", cfg.model.path,
                 layer.depth, hf_layer_prefix(layer))
    read = load_hf_weights(layers, cfg.model.path, mcfg)
    log.info("loaded %.1f MB of weights for this rank's layers from %s", read / 2**20, cfg.model.path)


def _expert_tensor_sequence(cfg: RunConfig, ds: dict, model, mcfg: PretrainedConfig, layout: RankLayout,
                            log: logging.Logger) -> dict:
    """What the engine needs to split the model: AutoEP's and AutoTP's sections and config, sequence-parallel
    attention; returns the DeepSpeed config to build the engine with."""
    if cfg.parallel.expert_parallel > 1:
        ds = {**ds, "expert_parallel": autoep_section(mcfg, cfg.parallel.expert_parallel)}
        model.config = mcfg  # AutoEP reads the expert count, top-k and routing from model.config
        if cfg.lora.r and cfg.lora.routed_experts:
            log.info("LoRA on AutoEP: %d MoE blocks' expert adapters go with their experts' shard",
                     expert_lora.detach_peft_experts(model))
    if cfg.parallel.tensor_parallel > 1:
        model.config = mcfg  # AutoTP reads the head counts from model.config
    if layout.sequence_shard:
        log.info("sequence parallel %d: %d attention layers all-to-all over the group; this rank holds tokens "
                 "%d/%d of each sequence", layout.degrees.sequence, sequence.enable(model, layout.sequence_shard),
                 layout.sequence_rank + 1, layout.degrees.sequence)
    return _deepspeed_view(ds, layout)


def _deepspeed_view(ds: dict, layout: RankLayout) -> dict:
    """DeepSpeed counts every rank of a stage as data-parallel (layout.py): to it a global batch holds each sample
    once per sequence rank."""
    if layout.degrees.sequence == 1:
        return ds
    return {**ds, "train_batch_size": ds["train_batch_size"] * layout.degrees.sequence}


def _engine(cfg: RunConfig, ds: dict, model, layout: RankLayout, log: logging.Logger, heads: int) -> DeepSpeedEngine:
    biases = snapshot_biases(model)
    lora_on_autoep = cfg.lora.r and cfg.parallel.expert_parallel > 1
    trainable = (p for p in model.parameters() if p.requires_grad)
    if clipped_apart(cfg):  # clipped apart (GroupClipping), so kept in groups of their own
        trainable = indexer_parameter_groups(model, list(trainable))
    with expert_lora.autoep_lora() if lora_on_autoep else contextlib.nullcontext(), \
            muon_context(ds, heads, log):
        # LoRA on AutoEP: a generator, which the engine lists after AutoEP's replacements, so the experts' adapters
        # are among them. Otherwise a list, whose order (AutoEP's replacements appended) older checkpoints' flat
        # optimizer partitions follow.
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable if lora_on_autoep
                                               else list(trainable), config=deepspeed_muon_config(ds),
                                               mpu=layout.tensor_groups)
    if cfg.parallel.pipeline_schedule == "zb-h1":
        engine = ZeroBubbleEngine.adopt(engine)
    restore_fp32_biases(engine.module, biases)
    keep_fp32_clip_norm(engine)  # ZeRO-0's gradient norm, as ZeRO 1-3's engines keep theirs
    timeouts = apply_timeout_to_all_groups(cfg.train.dist_timeout_s)
    log.info("%d process groups, each with a %s s timeout (train.dist_timeout_s)", len(timeouts),
             "/".join(f"{t:g}" for t in sorted(set(timeouts))))
    engine.config = redact(engine.config)  # the dict DeepSpeed saves into every checkpoint's .pt files
    if cfg.parallel.tensor_parallel > 1:
        # DeepSpeed's first-forward check that a TP group got one batch compares flat lists of tensors only and
        # raises on the (input_ids, position_ids) inputs of packed data and pairs; the group's ranks read the same
        # samples by construction (RankLayout.data_rank counts data-parallel replicas only).
        engine.first_dataloader_check.remove()
        sum_rope_key_grads(engine.module, layout.tensor_groups.get_tensor_model_parallel_group())
        log.info("tensor parallel %d: this rank holds %d elements of split weights, %d parameters in all",
                 cfg.parallel.tensor_parallel, sum(shard_elements(engine.module).values()),
                 sum(p.numel() for p in engine.module.parameters()))
    return engine
