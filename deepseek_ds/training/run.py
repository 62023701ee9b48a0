"""One rank's run: what training needs, built once by setup.build_run and never changed after (a frozen dataclass).
What changes as it trains lives in the objects it holds: the engine, the objective's state, the balancer's biases."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from deepspeed.runtime.engine import DeepSpeedEngine
from transformers import PretrainedConfig

from ..checkpoint import current_layout
from ..checkpoint.async_save import AsyncSaver
from ..checkpoint.tensor_names import layout_names
from ..config import RunConfig
from ..data import BlendedDataset, ChatDataset, GlobalBatchSampler, PackedDataset, sample_count
from ..models.deepseek_v32.indexer_loss import IndexerLoss
from ..models.grpo_loss import GRPOLoss
from ..models.loss import TokenWeightedLoss
from ..models.moe import LoadBalancer
from ..models.preference_loss import PreferenceLoss
from ..parallel.layout import RankLayout
from ..rewards import RewardFunctions
from .clip_groups import GroupClipping
from .metrics import PhaseTimes


@dataclass(kw_only=True, frozen=True)
class Run:
    """Everything one rank's training needs, built once by build_run."""
    cfg: RunConfig
    ds: dict                         # the resolved DeepSpeed config
    engine: DeepSpeedEngine          # a PipelineEngine when `pipeline`
    model_config: PretrainedConfig   # cfg.model.hf_config
    # train.objective's objectives.base.Objective (not imported: it annotates with Run), with what it keeps across steps
    objective: object
    loss_fn: TokenWeightedLoss | PreferenceLoss | GRPOLoss
    dataset: PackedDataset | ChatDataset | BlendedDataset  # the training data (data.open_training_data)
    dataset_dir: str
    rank: int
    world: int
    layout: RankLayout                   # degrees, groups, this rank's place (parallel/layout.py)
    pipeline: bool
    grad_accum: int
    log: logging.Logger
    balancer: LoadBalancer | None = None  # MoE load balancing (the loop moves its biases once per step)
    indexer: IndexerLoss | None = None  # indexer.stage warmup / sparse: DeepSeek-V3.2's indexer loss
    clipping: GroupClipping | None = None  # indexer.stage sparse with clipping: the LM and indexers clipped apart
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
