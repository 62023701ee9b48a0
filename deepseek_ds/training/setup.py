"""One rank's run, built in one visible sequence (build_run): its process (process.py), data, layout, model and the
DeepSpeed engine."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from transformers import PretrainedConfig

from ..checkpoint import current_layout
from ..checkpoint.async_save import AsyncSaver
from ..checkpoint.tensor_names import layout_names
from ..config import RunConfig, zero_stage
from ..data import (
    BlendedDataset,
    ChatDataset,
    DataError,
    GlobalBatchSampler,
    PackedDataset,
    dataset_info,
    ensure_builtin_dataset,
    load_tokenizer,
    open_training_data,
    sample_count,
)
from ..models.deepseek_v32.indexer import train_indexers
from ..models.deepseek_v32.indexer_loss import IndexerLoss
from ..models.grpo_loss import GRPOLoss, GRPOSettings
from ..models.hf_io import has_weights, load_hf_weights, mtp_layers_absent
from ..models.layers import mtp_depth
from ..models.lora import apply_lora
from ..models.loss import TokenWeightedLoss
from ..models.moe import LoadBalancer, autoep_section, resolve_settings, restore_fp32_biases, snapshot_biases
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
    prepare_config,
)
from ..models.preference_loss import PreferenceLoss
from ..models.presets import build_model_config
from ..models.tensor_parallel import shard_elements, sum_rope_key_grads
from ..models.tiled import tile_mlps
from ..parallel import expert_lora, sequence
from ..parallel.layout import Layout
from ..parallel.zero_bubble import ZeroBubbleEngine
from ..rewards import RewardFunctions, resolve_rewards
from ..utils.private_optimizer import keep_fp32_clip_norm
from ..utils.redact import redact
from .clip_groups import GroupClipping, indexer_parameter_groups
from .metrics import PhaseTimes
from .process import apply_timeout_to_all_groups, init_distributed, setup_logging, share_cpu_threads


@dataclass(kw_only=True)
class Run:
    """Everything one rank's training needs, built once by build_run."""
    cfg: RunConfig
    ds: dict                         # the resolved DeepSpeed config
    engine: DeepSpeedEngine          # a PipelineEngine when `pipeline`
    model_config: PretrainedConfig
    loss_fn: TokenWeightedLoss | PreferenceLoss  # PreferenceLoss: train.objective dpo
    dataset: PackedDataset | ChatDataset | BlendedDataset  # the training data (data.open_training_data)
    dataset_dir: str
    rank: int
    world: int
    layout: Layout                   # degrees, groups, this rank's place (parallel/layout.py)
    pipeline: bool
    grad_accum: int
    log: logging.Logger
    balancer: LoadBalancer | None = None  # MoE load balancing (the loop moves its biases once per step)
    indexer: IndexerLoss | None = None  # indexer.stage warmup / sparse: DeepSeek-V3.2's indexer loss
    clipping: GroupClipping | None = None  # indexer.stage sparse with clipping: the LM and indexers clipped apart
    # dpo: the training split's reference log-probabilities (objectives/dpo_reference); grpo with beta > 0 and no
    # LoRA: the frozen starting model (objectives/grpo.py).
    reference: object = None
    valid_reference: object = None   # dpo with eval.interval: the validation split's
    base_buffers: list | None = None  # dpo / grpo with LoRA: the base's starting buffers (router biases), its reference's
    rewards: RewardFunctions | None = None  # grpo: the reward functions (grpo.reward)
    tokenizer: object = None  # grpo: the dataset's tokenizer (EOS and padding of rollouts, completions decoded)
    phases: PhaseTimes | None = None  # grpo: the seconds of each step's generation, reference and update
    saver: AsyncSaver | None = None  # checkpoint.async: the background writer (checkpoint/async_save.py)

    @property
    def dp_rank(self) -> int:
        """The share of the global batch this rank reads (its sequence and tensor ranks read it too)."""
        return self.layout.data_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas."""
        return self.layout.data_size

    def sampler(self, consumed_samples: int = 0) -> GlobalBatchSampler:
        """This rank's share of the run's global batches, in the training order, after `consumed_samples`."""
        t = self.cfg.train
        return GlobalBatchSampler(sample_count(self.dataset), t.global_batch_size, t.micro_batch_size, self.dp_rank,
                                  self.dp_size, t.seed, shuffle=t.shuffle, consumed_samples=consumed_samples)

    @functools.cached_property
    def hf_names(self) -> dict[str, str]:
        """DeepSpeed module name -> HF name of this layout's parameters and buffers: every save maps the buffers with
        it, so it is built once (its layers on the meta device take 20 ms for tiny-v3)."""
        layout = current_layout(self)
        return layout_names(self.model_config, layout.scheme, layout.autoep)


def prepare_data(cfg: RunConfig, local_rank: int) -> str:
    """The dataset directory (a blend's first source: all share its tokenizer); the built-in corpus is built by one
    process per host while the others wait."""
    if cfg.data.named_dir:
        return cfg.data.named_dir
    vocab = build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides).vocab_size
    path = None
    if local_rank == 0:
        # A bar only on a terminal: in a redirected log it is one endless line.
        path = ensure_builtin_dataset(cfg.data.cache_dir, vocab_size=vocab, max_mb=cfg.data.builtin_max_mb,
                                      progress=sys.stderr.isatty())
    dist.barrier()
    if path is None:
        path = ensure_builtin_dataset(cfg.data.cache_dir, vocab_size=vocab, max_mb=cfg.data.builtin_max_mb,
                                      progress=False)
    return path


def build_run(cfg: RunConfig, ds: dict) -> Run:
    """One rank's run, as a short sequence of named steps: processes and logs, data, the layout's groups, the model
    (built, weights loaded, adapters added, parallelized), the engine."""
    rank, world = init_distributed(cfg.train.dist_timeout_s)
    threads = share_cpu_threads()
    log = setup_logging(cfg.train.output_dir, rank)
    if threads is not None:
        log.info("CPU: %d torch threads per rank (set OMP_NUM_THREADS to choose)", threads)
    dataset_dir = prepare_data(cfg, int(os.environ.get("LOCAL_RANK", 0)))
    mcfg = prepare_config(build_model_config(cfg.model.preset, cfg.model.path, cfg.model.overrides),
                          cfg.model.attn_implementation, cfg.model.experts_implementation)
    dataset = _open_training_data(cfg, dataset_dir, mcfg, rank, log)
    layout = Layout.create(cfg.parallel.degrees, world, rank)
    if rank == 0:
        log.info(layout.describe())
    rewards = resolve_rewards(cfg.grpo.reward, cfg.grpo.reward_weights) if cfg.train.objective == "grpo" else None
    loss_fn = _loss_fn(cfg, mcfg, rewards)
    model = _build_model(cfg, ds, mcfg, layout, loss_fn, log)
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
    ds = _parallelize(cfg, ds, model, mcfg, layout, log)
    engine = _engine(cfg, ds, model, layout, log, mcfg.num_attention_heads)
    if layout.sequence_shard:  # before the balancer's hooks
        sequence.keep_mtp_to_real_tokens(engine.module)
    return Run(cfg=cfg, ds=ds, engine=engine, model_config=mcfg, loss_fn=loss_fn, dataset=dataset,
               dataset_dir=dataset_dir, rank=rank, world=world, layout=layout,
               pipeline=cfg.parallel.pipeline_stages > 1,
               grad_accum=cfg.grad_accum_steps(layout.data_size), log=log,
               balancer=_balancer(cfg, mcfg, engine, layout), indexer=_indexer_loss(cfg, mcfg, engine), rewards=rewards,
               tokenizer=load_tokenizer(dataset_dir) if rewards else None,
               phases=PhaseTimes(("generation", "reference", "update"), engine.device) if rewards else None,
               clipping=GroupClipping(engine, engine.module) if sparse_indexers(cfg) and engine.gradient_clipping()
               else None,
               saver=AsyncSaver(log if rank == 0 else None) if cfg.checkpoint.async_ else None)


def sparse_indexers(cfg: RunConfig) -> bool:
    return cfg.indexer.stage == "sparse"


def _loss_scale(engine: DeepSpeedEngine):
    """fp16 scales the LM loss's gradients by its dynamic loss scale: the gradients added beside it must follow."""
    return (lambda: float(engine.optimizer.loss_scale)) if engine.fp16_enabled() else None


def _indexer_loss(cfg: RunConfig, mcfg: PretrainedConfig, engine: DeepSpeedEngine) -> IndexerLoss | None:
    if cfg.indexer.stage == "frozen":
        return None
    return IndexerLoss(engine.module, cfg.indexer.loss_weight, mcfg.num_hidden_layers, engine.device,
                       _loss_scale(engine))


def _loss_fn(cfg: RunConfig, mcfg: PretrainedConfig, rewards: RewardFunctions | None):
    """The objective's loss: next-token (with MTP), the preference losses (dpo) or GRPO's."""
    if cfg.train.objective == "dpo":
        p = cfg.preference
        return PreferenceLoss(p.loss, p.beta, p.label_smoothing, p.simpo_gamma, cfg.train.global_batch_size,
                              p.rpo_alpha)
    if cfg.train.objective == "grpo":
        g = cfg.grpo
        settings = GRPOSettings(g.beta, g.epsilon, g.epsilon if g.epsilon_high is None else g.epsilon_high,
                                g.loss_type, g.importance_sampling_level, g.max_completion_length)
        return GRPOLoss(settings, g.temperature, rewards.names)
    return TokenWeightedLoss(mtp_depth(mcfg), cfg.train.mtp_loss_weight)


def _balancer(cfg: RunConfig, mcfg: PretrainedConfig, engine: DeepSpeedEngine, layout: Layout) -> LoadBalancer | None:
    settings = resolve_settings(cfg.moe, mcfg)
    # The indexer's warm-up changes nothing but the indexer: no bias moves, the routers get no balance gradient.
    # Reinforcement learning keeps the balance the model has unless the moe section asks otherwise.
    rl_default = cfg.train.objective == "grpo" and not any(v is not None for v in vars(cfg.moe).values())
    if not (settings and settings.active) or cfg.indexer.stage == "warmup" or rl_default:
        return None
    loss_scale = _loss_scale(engine)
    # Each sequence's balance loss is computed whole on each of its sequence ranks (over the group's summed
    # statistics) and each TP rank of a replica holds the same sequences: the metrics' sums count tp x sp times.
    counted = cfg.train.global_batch_size * layout.degrees.tensor * layout.degrees.sequence
    return LoadBalancer(engine.module, settings, layout.gradient_size / cfg.train.global_batch_size, counted,
                        engine.device, loss_scale, layout.sequence_shard)


def _open_training_data(cfg: RunConfig, dataset_dir: str, mcfg: PretrainedConfig, rank: int, log: logging.Logger):
    info = dataset_info(dataset_dir)
    if info["vocab_size"] > mcfg.vocab_size:
        raise DataError(f"dataset {dataset_dir} uses a tokenizer with {info['vocab_size']} tokens but the model's "
                        f"vocab_size is {mcfg.vocab_size}; use a matching tokenizer or set model.overrides.vocab_size")
    dataset = open_training_data(cfg.data, dataset_dir, cfg.train.seed, cfg.train.shuffle)
    if rank == 0 and hasattr(dataset, "report"):
        log.info(dataset.report())  # what packing and truncation made of the samples
    return dataset


def _build_model(cfg: RunConfig, ds: dict, mcfg: PretrainedConfig, layout: Layout, loss_fn, log: logging.Logger):
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


def _parallelize(cfg: RunConfig, ds: dict, model, mcfg: PretrainedConfig, layout: Layout, log: logging.Logger) -> dict:
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


def _deepspeed_view(ds: dict, layout: Layout) -> dict:
    """DeepSpeed counts every rank of a stage as data-parallel (layout.py): to it a global batch holds each sample
    once per sequence rank."""
    if layout.degrees.sequence == 1:
        return ds
    return {**ds, "train_batch_size": ds["train_batch_size"] * layout.degrees.sequence}


def _engine(cfg: RunConfig, ds: dict, model, layout: Layout, log: logging.Logger, heads: int) -> DeepSpeedEngine:
    biases = snapshot_biases(model)
    lora_on_autoep = cfg.lora.r and cfg.parallel.expert_parallel > 1
    trainable = (p for p in model.parameters() if p.requires_grad)
    if sparse_indexers(cfg):  # clipped apart (GroupClipping), so kept in groups of their own
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
        # samples by construction (Layout.data_rank counts data-parallel replicas only).
        engine.first_dataloader_check.remove()
        sum_rope_key_grads(engine.module, layout.tensor_groups.get_tensor_model_parallel_group())
        log.info("tensor parallel %d: this rank holds %d elements of split weights, %d parameters in all",
                 cfg.parallel.tensor_parallel, sum(shard_elements(engine.module).values()),
                 sum(p.numel() for p in engine.module.parameters()))
    return engine
