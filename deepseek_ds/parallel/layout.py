"""The parallel layout of a run, in one place (as torchtitan's ParallelDims): its degrees checked against the world,
each rank's place in them, and the process groups every consumer asks for (the sampler, the loss weighting, the
metrics, checkpoints). World = pipeline x tensor x sequence x data-parallel; expert parallelism shards the experts
over data-parallel ranks (and sequence ranks, which route tokens like any other).

Ranks are ordered [data, sequence, tensor] inside a pipeline stage: a sequence group is `sequence` adjacent ranks, so
its all-to-alls stay on one host (and one NVLink domain) as long as it fits there.

DeepSpeed never hears of sequence parallelism here: to its engine and ZeRO every rank of a stage is data-parallel
(it averages gradients over data x sequence ranks, and ZeRO shards over them). Each sequence rank computes its
shard's share of the token-weighted loss, so that average is exactly the global batch's gradient. What differs from
plain data parallelism is only what a rank reads: the sequence ranks of a replica read the same sample and each
keeps its shard (parallel/sequence.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from torch.distributed import ProcessGroup

from ..models.tensor_parallel import init_tensor_parallel_groups
from ..utils.private_api import pipeline_data_parallel_group
from .degrees import Degrees, layout_errors
from .sequence import SequenceShard


@dataclass
class RankLayout:
    """One rank's place in the run's layout (a degrees.Layout describes the split itself, in numbers) and its process
    groups, made once (RankLayout.create) before the model is built.
    `data_rank`/`data_size`: which share of the global batch this rank reads (the sampler, evaluation); the sequence
    and tensor ranks of a replica share it. `gradient_group`/`gradient_size`: the ranks of this stage that DeepSpeed
    averages gradients over, over which token counts and losses are summed (None: the whole world)."""
    degrees: Degrees
    world: int
    rank: int
    data_rank: int
    data_size: int
    sequence_shard: SequenceShard | None = None  # sequence parallelism: this rank's shard of every sequence
    tensor_rank: int = 0
    gradient_group: ProcessGroup | None = None
    topology: PipeDataParallelTopology | None = None
    tensor_groups: object = None     # DeepSpeed's groups module with its data x tensor mesh (AutoTP's `mpu`)

    @classmethod
    def create(cls, d: Degrees, world: int, rank: int) -> RankLayout:
        """Every group of the layout; a collective: every rank calls it with the same degrees."""
        if world % d.model_parallel:
            raise ValueError(layout_errors(d, world, 1, 1)[0])
        if d.tensor > 1 and (d.pipeline > 1 or d.sequence > 1):
            raise ValueError("tensor parallelism combines with neither pipelines nor sequence parallelism "
                             "(config.validate refuses it)")
        dp = d.data(world)
        if d.pipeline > 1:
            if d.sequence > 1:
                raise ValueError("sequence parallelism with pipeline stages (config.validate refuses it)")
            topology = PipeDataParallelTopology(num_pp=d.pipeline, num_dp=dp)
            return cls(d, world, rank, topology.get_coord(rank).data, dp, topology=topology)
        if d.tensor > 1:
            mesh = init_tensor_parallel_groups(d.tensor)
            return cls(d, world, rank, mesh.get_data_parallel_rank(), mesh.get_data_parallel_world_size(),
                       tensor_rank=mesh.get_tensor_model_parallel_rank(),
                       gradient_group=mesh.get_data_parallel_group(), tensor_groups=mesh)
        sp = d.sequence
        group = None
        if sp > 1:
            for start in range(0, world, sp):  # new_group is collective: every rank makes every group
                ranks = list(range(start, start + sp))
                made = dist.new_group(ranks)
                if rank in ranks:
                    group = made
        shard = SequenceShard(group, rank % sp, sp) if sp > 1 else None
        return cls(d, world, rank, rank // sp, dp, sequence_shard=shard)

    def bind(self, model) -> None:
        """With a pipeline, the data-parallel group is the one DeepSpeed's PipelineModule made from our topology."""
        if self.degrees.pipeline > 1:
            self.gradient_group = pipeline_data_parallel_group(model)

    @property
    def gradient_size(self) -> int:
        return self.degrees.gradient_ranks(self.world)

    @property
    def sequence_rank(self) -> int:
        return self.sequence_shard.rank if self.sequence_shard else 0

    @property
    def counts_once(self) -> bool:
        """Whether this rank's sums count in metrics summed over the world: the tensor ranks of a replica compute the
        same losses (one counts); sequence ranks compute different tokens' and all count."""
        return self.tensor_rank == 0

    @property
    def writes_replica_files(self) -> bool:
        """One rank per stage writes what every rank of the stage holds alike (the router biases)."""
        return self.data_rank == 0 and self.tensor_rank == 0 and self.sequence_rank == 0

    def describe(self) -> str:
        d = self.degrees
        return (f"layout: world {self.world} = pp {d.pipeline} x tp {d.tensor} x sp {d.sequence} x dp "
                f"{self.data_size}" + (f", experts over {d.expert} ranks" if d.expert > 1 else ""))
