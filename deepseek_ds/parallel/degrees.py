"""A run's parallel degrees and their arithmetic against the world size, and its Layout: plain numbers, importable by
the config, checkpoints and `plan` before any process or process group exists (parallel/layout.py builds the groups)."""

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


SEQUENTIAL, PIPELINE = "sequential", "pipeline"  # how the model's modules are named: SequentialLM's or PipelineModule's


@dataclass(frozen=True)
class Layout:
    """How a run is split, the one layout type: training's (checkpoint.current_layout of a run), checkpoint metadata's
    (saved as this dict, read back by from_dict) and `plan`'s. `data_parallel` counts DeepSpeed's data-parallel ranks
    of a stage, which its files are split over: data-parallel replicas x sequence ranks. `pipeline_parts` (a pipeline's
    partition) and the batch shape are None where they are not known (plan; checkpoints that predate them)."""
    data_parallel: int
    pipeline_stages: int = 1
    tensor_parallel: int = 1
    sequence_parallel: int = 1
    expert_parallel: int = 1
    zero_stage: int = 0
    precision: str = "fp32"
    pipeline_parts: tuple[int, ...] | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None

    @property
    def replicas(self) -> int:
        """Model replicas, each reading its own share of the global batch."""
        return self.data_parallel // self.sequence_parallel

    @property
    def scheme(self) -> str:
        return PIPELINE if self.pipeline_stages > 1 else SEQUENTIAL

    @property
    def autoep(self) -> bool:
        """Whether DeepSpeed's AutoEP replaced the MoE blocks (it names their tensors differently)."""
        return self.expert_parallel > 1

    def same_files(self, other: Layout) -> bool:
        """Whether DeepSpeed's checkpoint files of one load natively into the other: the batch shape and how the
        data-parallel ranks split into replicas and sequence ranks are not in them."""
        def files(lay: Layout) -> tuple:
            return (lay.data_parallel, lay.pipeline_stages, lay.pipeline_parts, lay.zero_stage, lay.precision,
                    lay.expert_parallel, lay.tensor_parallel)
        return files(self) == files(other)

    def describe(self) -> str:
        tp = f"tp={self.tensor_parallel} " if self.tensor_parallel > 1 else ""
        sp = f"sp={self.sequence_parallel} " if self.sequence_parallel > 1 else ""
        # DualPipeV (the only schedule with two stages per pipeline rank) files differ from 1F1B's of the same pp.
        dual = " dualpipev" if self.pipeline_parts and len(self.pipeline_parts) == 2 * self.pipeline_stages + 1 else ""
        return (f"dp={self.data_parallel} pp={self.pipeline_stages}{dual} ep={self.expert_parallel} {tp}{sp}"
                f"zero={self.zero_stage} {self.precision}")

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        parts = d.get("pipeline_parts")
        return cls(**{**d, "pipeline_parts": tuple(parts) if parts else None})


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
