"""One rank's run (run.py), built in one visible sequence (build_run): its process (process.py), data, layout, loss,
the parallelized model and its engine (parallelize.py), and what the loop needs beside them."""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from transformers import PretrainedConfig

from ..checkpoint.async_save import AsyncSaver
from ..config import RunConfig
from ..data import (
    DataError,
    dataset_info,
    ensure_builtin_dataset,
    load_tokenizer,
    open_training_data,
)
from ..models.deepseek_v32.indexer_loss import IndexerLoss
from ..models.grpo_loss import GRPOLoss, GRPOSettings
from ..models.layers import mtp_depth
from ..models.loss import TokenWeightedLoss
from ..models.moe import LoadBalancer, resolve_settings
from ..models.preference_loss import PreferenceLoss
from ..parallel.layout import RankLayout
from ..rewards import RewardFunctions, resolve_rewards
from .clip_groups import GroupClipping, clipped_apart
from .metrics import PhaseTimes
from .objectives import make_objective
from .parallelize import parallelize
from .process import init_distributed, setup_logging, share_cpu_threads
from .run import Run


def prepare_data(cfg: RunConfig, local_rank: int) -> str:
    """The dataset directory (a blend's first source: all share its tokenizer); the built-in corpus is built by one
    process per host while the others wait."""
    if cfg.data.named_dir:
        return cfg.data.named_dir
    vocab = cfg.model.hf_config.vocab_size
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
    mcfg = cfg.model.hf_config
    dataset = _open_training_data(cfg, dataset_dir, mcfg, rank, log)
    layout = RankLayout.create(cfg.parallel.degrees, world, rank)
    if rank == 0:
        log.info(layout.describe())
    rewards = resolve_rewards(cfg.grpo.reward, cfg.grpo.reward_weights) if cfg.train.objective == "grpo" else None
    loss_fn = _loss_fn(cfg, mcfg, rewards)
    engine, ds = parallelize(cfg, ds, layout, loss_fn, log)
    return Run(cfg=cfg, ds=ds, engine=engine, model_config=mcfg, objective=make_objective(cfg.train.objective),
               loss_fn=loss_fn, dataset=dataset,
               dataset_dir=dataset_dir, rank=rank, world=world, layout=layout,
               pipeline=cfg.parallel.pipeline_stages > 1,
               grad_accum=cfg.grad_accum_steps(layout.data_size), log=log,
               balancer=_balancer(cfg, mcfg, engine, layout), indexer=_indexer_loss(cfg, mcfg, engine), rewards=rewards,
               tokenizer=load_tokenizer(dataset_dir) if rewards else None,
               phases=PhaseTimes(("generation", "reference", "update"), engine.device) if rewards else None,
               clipping=GroupClipping(engine, engine.module) if clipped_apart(cfg) and engine.gradient_clipping()
               else None,
               saver=AsyncSaver(log if rank == 0 else None) if cfg.checkpoint.async_ else None)


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


def _balancer(cfg: RunConfig, mcfg: PretrainedConfig, engine: DeepSpeedEngine,
              layout: RankLayout) -> LoadBalancer | None:
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
