"""The run YAML's sections as dataclasses. Each field says what it means, and each section checks its own fields in
`__post_init__` (a value that is wrong whatever else is configured); rules that need several sections, the
DeepSpeed JSON or the world size are in validate.py."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig

from ..models.deepseek_v32.indexer import STAGES as INDEXER_STAGES
from ..models.pipeline import prepare_config
from ..models.presets import build_model_config
from ..parallel.degrees import Degrees
from .errors import ConfigError  # noqa: F401 - imported from here by loading, validate and deepspeed_json
from .errors import at_least as _at_least
from .errors import refuse as _refuse
from .objective_sections import GrpoSection, PreferenceSection

NAN_POLICIES = ("skip", "stop")
RESUME_SCHEDULES = ("keep", "replan")
BUILTIN_CORPORA = ("stdlib",)
TRUNCATIONS = ("drop", "truncate_left", "truncate_right")
OBJECTIVES = ("lm", "dpo", "grpo")
PIPELINE_SCHEDULES = ("1f1b", "zb-h1", "dualpipev")


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in the run YAML: its name, or its metadata "key" where that is a Python keyword (async)."""
    return f.metadata.get("key", f.name)


def _blend_problems(path: str | None, blend) -> list[str]:
    if path is not None:
        return ["data.path and data.blend are both set: a blend names its datasets itself; keep one of them"]
    if not isinstance(blend, dict) or not blend:
        return ["data.blend must map dataset directories to weights, e.g. {data/web: 0.7, data/code: 0.3}"]
    return [f"data.blend weight of {d!r} is {w!r}: weights must be numbers > 0 (drop a source to leave it out)"
            for d, w in blend.items() if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0]


@dataclass
class ModelSection:
    preset: str | None = "tiny-v3"
    """A built-in architecture (models/presets.py), used when `path` is null."""
    path: str | None = None
    """A local Hugging Face directory: its config.json and, if present, its safetensors weights."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """transformers config fields set over the preset's or the directory's, e.g. num_hidden_layers."""
    attn_implementation: str = "sdpa"
    """transformers' attention implementation."""
    experts_implementation: str = "grouped_mm"
    """transformers' routed-experts implementation: grouped_mm or eager."""
    activation_checkpoint_interval: int = 0
    """Recompute activations every N layers in the backward pass; 0: off."""
    partition_method: str = "balanced"
    """How layers are cut into pipeline stages (models/pipeline.py)."""

    def __post_init__(self):
        _refuse([] if self.preset is not None or self.path is not None else
                ["set model.preset (e.g. tiny-v3) or model.path (a local HF directory)"])

    @functools.cached_property
    def hf_config(self) -> PretrainedConfig:
        """The model's transformers config (preset or path, overrides, kernel choices), built once per process: every
        check and the run read this one. Raises ModelConfigError (or transformers' TypeError / ValueError) on a bad
        model section, each time it is asked."""
        return prepare_config(build_model_config(self.preset, self.path, self.overrides), self.attn_implementation,
                              self.experts_implementation)


@dataclass
class DataSection:
    path: str | None = None
    """A dataset made by `deepseek-ds data prepare`; null: the built-in corpus (or data.blend)."""
    blend: dict[str, float] | None = None
    """Prepared dataset directories (one tokenizer, one format) -> weights, instead of data.path: the training order
    interleaves them so that every prefix holds each source within one sample of its share (data/blend.py), each
    source in its own order of train.seed; a small source's epochs wrap inside the blend."""
    builtin: str | None = "stdlib"
    """The built-in corpus (the Python standard library's sources), built into `cache_dir` on first use."""
    builtin_max_mb: float = 8.0
    """How many MB of source text the built-in corpus reads."""
    cache_dir: str = "data_cache"
    """Where the built-in corpus is built (relative: to the current directory)."""
    seq_len: int = 128
    """Tokens per training sample."""
    packing: bool = False
    """Chat (instruction) datasets: pack whole samples into each sequence of seq_len (first fit, in order; the rest
    padded with label -100), attention never crossing samples; false: one sample per sequence. Raw text is always
    packed into a continuous stream (see document_mask)."""
    truncation: str = "drop"
    """A chat sample longer than seq_len: "drop" it, "truncate_left" or "truncate_right" it; counted and reported,
    never split across two sequences."""
    document_mask: bool = False
    """Raw text: attention and position_ids restart at each document boundary (EOS) inside a sequence, as packing does
    for chat samples; false: one causal stream."""

    def __post_init__(self):
        problems = _at_least("data", 2, seq_len=self.seq_len)
        if self.truncation not in TRUNCATIONS:
            problems.append(f"data.truncation = {self.truncation!r}: use 'drop', 'truncate_left' or 'truncate_right'")
        if self.blend is not None:
            problems += _blend_problems(self.path, self.blend)
        elif self.path is None and self.builtin not in BUILTIN_CORPORA:
            problems.append(f"data.builtin = {self.builtin!r}: the only built-in corpus is 'stdlib'; or set data.path")
        _refuse(problems)

    @property
    def named_dir(self) -> str | None:
        """The dataset directory the section names: data.path, or data.blend's first (all share its tokenizer)."""
        return self.path or (next(iter(self.blend)) if self.blend else None)


@dataclass
class TrainSection:
    steps: int = 300
    """Optimizer steps of the whole run (a resume continues up to it)."""
    seed: int = 1234
    """Seeds the weights, the data order and dropout."""
    lr: float = 3e-3
    """Peak learning rate, after the warm-up."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warm-up steps; 0: none."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Global gradient-norm clipping."""
    micro_batch_size: int = 8
    """Samples per rank per forward/backward pass."""
    global_batch_size: int = 16
    """Samples per optimizer step: micro_batch_size x gradient accumulation x data-parallel size."""
    shuffle: bool = True
    output_dir: str = "runs/default"
    """Metrics, logs, plots, resolved_config.yaml and (by default) checkpoints (relative: to the current directory)."""
    dist_timeout_s: int = 1800
    """Collectives waiting longer than this fail, in every process group (a dead or hung host ends the job)."""
    nan_policy: str = "stop"
    """A non-finite loss: "skip" the step, or "stop" (save, then end the run)."""
    max_consecutive_skips: int = 50
    """Steps in a row DeepSpeed may discard (fp16 overflow, non-finite gradients) before the run saves and stops;
    0: no limit. fp16's first steps skip while the loss scale settles (about 16 from the default 2^16)."""
    peak_tflops: float | None = None
    """Per-device peak TFLOP/s for MFU; null: the known GPU's bf16 dense peak."""
    resume_schedule: str = "keep"
    """A resume with another train.steps: "keep" the checkpoint's learning-rate schedule (past its end the rate stays
    at min_lr) or "replan" the warm-up + cosine over the new train.steps from the current step."""
    log_interval: int = 10
    """Steps between plain progress lines when the console is not a terminal (Slurm, nohup); a bar otherwise."""
    compile: bool = False
    """torch.compile each decoder layer (regional compilation, as torchtitan does): same losses, faster steps once
    compiled; false: eager."""
    tiled_mlp: int = 0
    """Tokens per tile of every MLP (ALST's tiled compute: its [tokens, intermediate] activations exist one tile at a
    time, at the cost of one more MLP forward; long sequences, with the chunked loss); 0: untiled. A tile about
    hidden_size tokens long is ALST's choice. Not with parallel.expert_parallel > 1."""
    mtp_loss_weight: float = 0.3
    """lambda of DeepSeek-V3's multi-token-prediction loss (0.3, later 0.1, in its training); the depth is the model's
    num_nextn_predict_layers (model.overrides), 0 in the tiny presets and 1 in deepseek-v3."""
    objective: str = "lm"
    """"lm": next-token loss; "dpo": preference optimization on a `--format preference` dataset (the preference
    section: DPO, IPO or SimPO); "grpo": RL with verifiable rewards on a `--format prompts` dataset (the grpo
    section)."""

    def __post_init__(self):
        problems = _at_least("train", 1, steps=self.steps, micro_batch_size=self.micro_batch_size,
                             global_batch_size=self.global_batch_size, log_interval=self.log_interval,
                             dist_timeout_s=self.dist_timeout_s)
        problems += _at_least("train", 0, max_consecutive_skips=self.max_consecutive_skips, tiled_mlp=self.tiled_mlp)
        if self.nan_policy not in NAN_POLICIES:
            problems.append(f"train.nan_policy = {self.nan_policy!r}: use 'skip' (drop the step and go on) or 'stop' "
                            "(save a checkpoint and end the run)")
        if self.resume_schedule not in RESUME_SCHEDULES:
            problems.append(f"train.resume_schedule = {self.resume_schedule!r}: use 'keep' (the checkpoint's schedule) "
                            "or 'replan' (warm-up + cosine over the new train.steps)")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            problems.append(f"train.peak_tflops = {self.peak_tflops}: must be > 0 (TFLOP/s of one device), or null")
        if self.mtp_loss_weight < 0:
            problems.append(f"train.mtp_loss_weight = {self.mtp_loss_weight} must be >= 0")
        if self.objective not in OBJECTIVES:
            problems.append(f"train.objective = {self.objective!r}: use 'lm' (next-token loss), 'dpo' (preference "
                            "optimization, the preference section) or 'grpo' (RL, the grpo section)")
        _refuse(problems)


@dataclass
class ParallelSection:
    pipeline_stages: int = 1
    """Pipeline-parallel stages (DeepSpeed's PipelineModule); 1: none."""
    expert_parallel: int = 1
    """Ranks the routed experts are sharded over (DeepSpeed AutoEP); must divide the data-parallel size."""
    tensor_parallel: int = 1
    """Ranks each attention and MLP matrix is split over (DeepSpeed AutoTP); 1: none."""
    sequence_parallel: int = 1
    """Ranks each sequence is split over (DeepSpeed-Ulysses for MLA: attention all-to-alls sequence shards into head
    shards); 1: none. world = pipeline_stages x tensor_parallel x sequence_parallel x data-parallel size."""
    pipeline_schedule: str = "1f1b"
    """The order of the pipeline's forward and backward passes: 1f1b (DeepSpeed's), zb-h1 (zero bubble: each backward
    split into its input and weight halves, the weight halves filling the bubble) or dualpipev (DeepSeek's DualPipe
    folded into a V: each rank holds stage r and stage 2p-1-r)."""

    def __post_init__(self):
        problems = _at_least("parallel", 1, pipeline_stages=self.pipeline_stages, expert_parallel=self.expert_parallel,
                             tensor_parallel=self.tensor_parallel, sequence_parallel=self.sequence_parallel)
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            problems.append(f"parallel.pipeline_schedule = {self.pipeline_schedule!r}: use one of "
                            f"{', '.join(PIPELINE_SCHEDULES)}")
        _refuse(problems)

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.pipeline_stages, self.tensor_parallel, self.sequence_parallel, self.expert_parallel)


@dataclass
class LoraSection:
    """LoRA fine-tuning with peft: low-rank adapters on the named modules; every other weight is frozen (no gradient,
    no optimizer state, not in checkpoints: the base is read from model.path)."""
    r: int = 0
    """Adapter rank; 0: LoRA off (full fine-tuning)."""
    alpha: float = 16.0
    """Scaling: the update is (alpha / r) x B A."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] | str | None = None
    """transformers' module names that get adapters (e.g. q_b_proj, kv_b_proj, o_proj), each matching a module
    name or its dotted suffix as peft matches them; `all-linear` (peft's shorthand): every linear layer but the
    output head, and on DeepSeek models but the MLPs' gate/up/down_proj too (peft would load those names back onto
    the fused routed experts); null: the model family's default (models/lora.py)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full alongside the adapters (e.g. lm_head)."""
    routed_experts: bool = False
    """Adapters on the routed experts too (MoE models); false: only attention, dense and shared-expert MLPs."""

    def __post_init__(self):
        problems = _at_least("lora", 0, r=self.r)
        if self.alpha <= 0:
            problems.append(f"lora.alpha = {self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            problems.append(f"lora.dropout = {self.dropout} must be in [0, 1)")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            # peft reads any other string as a regular expression: a typo there would match nothing, silently.
            problems.append(f"lora.target_modules = {self.target_modules!r}: a list of module names (e.g. "
                            "[q_b_proj, o_proj]), all-linear (every linear layer but the output head) or null for "
                            "the model family's default")
        elif self.target_modules is not None and not self.target_modules:
            problems.append("lora.target_modules is empty: name modules (e.g. [q_b_proj, o_proj]) or use null for "
                            "the model family's default")
        _refuse(problems)


@dataclass
class CheckpointSection:
    dir: str | None = None
    """Where checkpoints go; null: <train.output_dir>/checkpoints."""
    interval: int = 0
    """Save every N steps; 0: only at the end."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted."""
    lock_stale_s: int = 300
    """A checkpoint.dir lock whose heartbeat is older than this is stale (its job died on another host) and is taken
    over with a warning; a holder on this host is checked by its pid instead."""
    async_: bool = field(default=False, metadata={"key": "async"})
    """Save in the background: the step that saves returns once the state is copied to host memory (pinned on a GPU);
    a writer thread writes, checksums and fsyncs it, and the tag is published (and retention runs) only when every
    rank's files are durable. One save at a time (the next waits, and says so in the log); the end of training and a
    stop on a signal wait for it. A failed background save ends the job at the next step with one line."""

    def __post_init__(self):
        _refuse(_at_least("checkpoint", 1, keep=self.keep, lock_stale_s=self.lock_stale_s))


@dataclass
class EvalSection:
    interval: int = 0
    """Evaluate on the validation split every N steps; 0: never."""
    batches: int = 4
    """Global batches per evaluation."""
    task: str | None = None
    """A held-out task (JSON Lines, chat or prompt/response) scored at each eval.interval: greedy generation, exact
    match and BLEU, as `deepseek-ds eval --task`; null: none."""
    task_items: int = 0
    """Items of eval.task scored each time (its first N); 0: all."""
    task_max_new_tokens: int = 64
    """Generation length limit per eval.task item."""

    def __post_init__(self):
        if self.interval < 0 or self.batches < 1:
            _refuse([f"eval.interval ({self.interval}) must be >= 0 (0: no evaluation) and eval.batches "
                     f"({self.batches}) >= 1"])
        _refuse(_at_least("eval", 0, task_items=self.task_items)
                + _at_least("eval", 1, task_max_new_tokens=self.task_max_new_tokens))


@dataclass
class MoESection:
    """DeepSeekMoE load balancing (models/moe.py). null: the model family's published value (DeepSeek-V3: bias
    update speed 0.001, sequence-wise loss 1e-4; DeepSeek-V2: expert-level loss 0.003, device-level loss 0.05,
    communication loss 0.02; the last two only for models with more than one expert group)."""
    bias_update_speed: float | None = None
    """gamma of V3's auxiliary-loss-free balancing; 0: off."""
    seq_aux_alpha: float | None = None
    """Sequence-wise (V3) = expert-level (V2) balance loss factor; 0: off."""
    device_aux_alpha: float | None = None
    """V2 device-level balance loss over the model's n_group groups; 0: off."""
    comm_aux_alpha: float | None = None
    """V2 communication balance loss (tokens sent to each group); 0: off."""

    def __post_init__(self):
        _refuse([f"moe.{k} = {v} must be >= 0 (0 turns it off) or null (the model family's default)"
                 for k, v in dataclasses.asdict(self).items() if v is not None and v < 0])


@dataclass
class IndexerSection:
    """DeepSeek-V3.2's lightning indexer (models/deepseek_v32/indexer.py; V3.2 report sec. 2.1.1)."""
    stage: str = "frozen"
    """frozen: the indexer does not train (transformers' module); warmup: attention dense, the indexer alone trains, on
    the KL to the main attention over the causal keys (every other parameter frozen, no router-bias update); sparse:
    attention keeps the indexer's top-k keys, the model trains on the LM loss and the indexer on the KL over the
    selected keys, from detached inputs."""
    loss_weight: float = 1.0
    """loss = lm_loss + loss_weight x indexer_loss (the mean over the DSA layers and counted query tokens of KL_t)."""

    def __post_init__(self):
        problems = []
        if self.stage not in INDEXER_STAGES:
            problems.append(f"indexer.stage = {self.stage!r}: use 'frozen' (no indexer training), 'warmup' (dense "
                            "attention, the indexer alone learns) or 'sparse' (top-k attention, everything learns)")
        if not self.loss_weight > 0:
            problems.append(f"indexer.loss_weight = {self.loss_weight} must be > 0 (indexer.stage frozen turns the "
                            "indexer loss off)")
        _refuse(problems)


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    moe: MoESection = field(default_factory=MoESection)
    lora: LoraSection = field(default_factory=LoraSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)
    indexer: IndexerSection = field(default_factory=IndexerSection)
    deepspeed_config: str = "ds_configs/zero1.json"
    """The DeepSpeed JSON when --deepspeed_config is not given (relative paths: see loading.py)."""

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.train.output_dir, "checkpoints")

    def data_parallel_size(self, world_size: int) -> int:
        """Model replicas: world / (pipeline stages x tensor- x sequence-parallel ranks), at least 1 (validate()
        refuses a world size that these do not divide)."""
        return self.parallel.degrees.data(world_size)

    def grad_accum_steps(self, data_parallel: int) -> int:
        """Micro-batches per rank and optimizer step, from global = micro x grad-accum x data-parallel (at least 1)."""
        return max(self.train.global_batch_size // (self.train.micro_batch_size * data_parallel), 1)

    def to_dict(self) -> dict:
        """As the run YAML spells it (yaml_key)."""
        out = dataclasses.asdict(self)
        for section in dataclasses.fields(self):
            if dataclasses.is_dataclass(value := getattr(self, section.name)):
                for f in dataclasses.fields(value):
                    out[section.name][yaml_key(f)] = out[section.name].pop(f.name)
        return out
