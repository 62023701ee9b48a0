"""A run's parallel degrees and their arithmetic against the world size: plain numbers, importable by the config
before any process or process group exists (parallel/layout.py builds the groups)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Degrees:
    """The layout as the run config states it; `data` follows from the world size."""
    pipeline: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one replica of the model and read one share of the batch."""
        return self.pipeline * self.tensor * self.sequence

    def data(self, world: int) -> int:
        """Data-parallel replicas: each reads its own share of the global batch."""
        return max(world // self.model_parallel, 1)

    def gradient_ranks(self, world: int) -> int:
        """Ranks of one stage that DeepSpeed averages gradients over (and ZeRO shards over): data x sequence."""
        return self.data(world) * self.sequence


def layout_errors(d: Degrees, world: int, micro_batch_size: int, global_batch_size: int) -> list[str]:
    """The world size against the degrees, and the batch arithmetic; one line each naming the field and the fix."""
    if world % d.model_parallel:
        return [f"world size {world} is not divisible by pipeline_stages({d.pipeline}) x tensor_parallel({d.tensor}) "
                f"x sequence_parallel({d.sequence}) = {d.model_parallel}, so there is no whole number of data-parallel "
                "replicas dp (world = pp x tp x sp x dp); change parallel.pipeline_stages, parallel.tensor_parallel, "
                "parallel.sequence_parallel or the number of ranks"]
    errors = []
    dp = d.data(world)
    per_step = micro_batch_size * dp
    if global_batch_size % per_step:
        errors.append(f"train.global_batch_size ({global_batch_size}) must equal micro_batch_size ({micro_batch_size}) "
                      f"x grad_accum x data_parallel ({dp} = world {world} / (pp {d.pipeline} x tp {d.tensor} x sp "
                      f"{d.sequence})); use a multiple of {per_step}, e.g. "
                      f"{per_step * max(1, round(global_batch_size / per_step))}")
    if d.expert > 1 and d.gradient_ranks(world) % d.expert:
        errors.append(f"parallel.expert_parallel ({d.expert}) must divide the data-parallel ranks "
                      f"({d.gradient_ranks(world)} = dp {dp} x sp {d.sequence})")
    return errors
