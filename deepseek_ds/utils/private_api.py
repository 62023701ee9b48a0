"""The one seam to DeepSpeed's, torch's and transformers' private names: every access the project makes to one goes
through a small named function or constant here or in its siblings (private_pipeline.py: DeepSpeed's pipeline engine;
private_optimizer.py: the ZeRO optimizers' gradient norm and Muon's update), each saying why no public API does it. DeepSpeed is pinned exactly
(requirements/cpu.txt); after an upgrade, tests/test_private_api.py walks PRIVATE and names each entry the new
version lacks, with its reason, so an upgrade breaks in this one place."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
from deepspeed.moe import ep_experts
from deepspeed.sequence.layer import _SeqAllToAll
from deepspeed.utils import groups
from torch.distributed import ProcessGroup, distributed_c10d
from torch.utils import cpp_extension

# (owner's import path, attribute, why the project needs it). An owner that is a class may hold the attribute on
# its instances only (set in its __init__): the test then finds it in the class's source; of a function, the
# attribute is a parameter.
PRIVATE: tuple[tuple[str, str, str], ...] = (
    # torch process groups (training/process.py)
    ("torch.distributed.distributed_c10d", "_world", "every process group of this rank, to give each the timeout"),
    ("torch.distributed.distributed_c10d._World", "pg_map", "every process group of this rank, to give each the "
     "timeout"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout", "DeepSpeed's groups are made without a timeout "
     "(deepspeed.comm.new_group takes none), so a hung peer held them the backend's default"),
    ("torch.distributed.ProcessGroup", "_get_backend", "reading a group's timeout back (the timeout test)"),
    ("torch.distributed.ProcessGroup", "_device_types", "reading a group's timeout back (the timeout test)"),
    ("torch.distributed.ProcessGroupGloo.Options", "_timeout", "reading a group's timeout back (the timeout test)"),
    # DeepSpeed's engine (checkpoint/)
    ("torch.save", "_use_new_zipfile_serialization", "DeepSpeed's torch engine's file format, kept when our "
     "checkpoint engine writes its files"),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "_copy_recovery_script", "copy DeepSpeed's recovery scripts only "
     "when changed: rewriting them at every save waits for the filesystem's journal"),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "_take_model_step", "the first change of the saved state: "
     "checkpoint.async holds it until the background copy is done"),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "_config", "load_universal_checkpoint is read only while loading: "
     "set per resume from the checkpoint found"),
    ("deepspeed.runtime.config.DeepSpeedConfig", "load_universal_checkpoint", "the universal loader's switch"),
    ("deepspeed.ops.adam.FusedAdam", "_dummy_overflow_buf", "replaying CPU FusedAdam's kernel steps on resume"),
    ("torch.nn.Module", "_non_persistent_buffers_set", "which buffers a state dict leaves out, without state_dict() "
     "(it would touch ZeRO-3's partitioned parameters)"),
    ("deepspeed.utils.groups", "_get_expert_parallel_rank", "which experts a rank holds (AutoEP's placement)"),
    ("deepspeed.utils.groups", "_get_expert_data_parallel_rank", "which replica of its experts a rank holds"),
    # DeepSpeed's AutoEP and expert kernels (parallel/expert_lora.py)
    ("deepspeed.moe.ep_experts", "_run_experts_triton_grouped_mm", "GroupedExperts' kernels, run on LoRA-adapted "
     "weights"),
    ("deepspeed.moe.ep_experts", "_run_experts_grouped_mm", "GroupedExperts' kernels, run on LoRA-adapted weights"),
    ("deepspeed.moe.ep_experts", "_run_experts_grouped_mm_fused_gate_up", "GroupedExperts' kernels, run on "
     "LoRA-adapted weights"),
    ("deepspeed.moe.ep_experts", "_run_experts_for_loop", "GroupedExperts' kernels, run on LoRA-adapted weights"),
    ("deepspeed.module_inject.auto_ep.AutoEP", "_replace_moe_layer_without_retarget", "AutoEP's replacement of "
     "one MoE block: LoRA attaches its experts' adapters to it (AutoEP has no hook)"),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "_configure_optimizer", "an optimizer over frozen experts is "
     "built as a dense model's (ZeRO asserts an MoE model has an expert group)"),
    # sequence and pipeline parallelism (parallel/)
    ("deepspeed.sequence.layer", "_SeqAllToAll", "Ulysses' all-to-all, which reads each tensor's own head size "
     "(MLA's q/k and v heads differ)"),
    ("transformers.PretrainedConfig", "_attn_implementation", "transformers' attention choice lives on the config "
     "only: sequence parallelism swaps in its own"),
    ("deepspeed.runtime.pipe.module.PipelineModule", "_grid", "the data-parallel group PipelineModule made from "
     "our topology"),
    ("deepspeed.runtime.pipe.module.PipelineModule", "_partition_layers", "our layer partition, computed before "
     "construction (models/pipeline.py overrides it)"),
    ("deepspeed.runtime.pipe.module.PipelineModule", "_set_bounds", "this stage's layers of our partition"),
    ("deepspeed.runtime.pipe.module.PipelineModule", "_topo", "this rank's pipeline stage, while partitioning"),
    ("torch.distributed.pipelining", "_backward", "zb-h1's split backward: torch's input and weight halves of a "
     "stage's backward (parallel/zero_bubble.py)"),
    ("torch.distributed.pipelining._backward", "stage_backward_input", "zb-h1's input half"),
    ("torch.distributed.pipelining._backward", "stage_backward_weight", "zb-h1's weight half"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine", "_train_schedule", "PipelineEngineExtension: an engine's own "
     "training schedule (DeepSpeed's DualPipeVEngine extends PipelineEngine the same way)"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine", "_exec_schedule", "PipelineEngineExtension: around one "
     "schedule's run"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine", "_exec_backward_pass", "PipelineEngineExtension: DeepSpeed's "
     "whole backward of one micro-batch"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine", "_running_engine_backward", "PipelineEngineExtension: set "
     "around a backward of the engine's own, as PipelineEngine's backward sets it (DeepSpeed's hooks read it)"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine", "_backward_prologue_per_tensor", "PipelineEngineExtension: "
     "DeepSpeed's scaling of the gradient reaching the last stage's outputs"),
    ("deepspeed.runtime.pipe.p2p", "_grid", "zb-h1's sends, started without waiting for the receiver"),
    ("transformers.PretrainedConfig", "_experts_implementation", "transformers' experts kernel choice lives on the "
     "config only"),
    # models/moe.py, models/tensor_parallel.py
    ("torch", "_C", "torch's bindings, which hold autograd's current graph task"),
    ("torch._C", "_current_graph_task_id", "activation checkpointing's re-run forwards are not new traffic"),
    ("deepspeed.utils.groups", "_init_tp_mesh_device", "the TP mesh, made before deepspeed.initialize"),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "_global_grad_norm", "what get_global_grad_norm returns: "
     "the ZeRO-0 engine clips fp32 gradients without keeping their norm"),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "_get_norm_groups", "each sub-group's gradient "
     "norm, for clipping per group (training/clip_groups.py)"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "_average_expert_grad_norms", "the expert "
     "groups' gradient norms as DeepSpeed combines them, for clipping per group"),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "_apply_muon_to_accumulated_grads", "ZeRO-3's "
     "Muon, run after the gradient norm and per projection of a fused gate_up_proj (utils/private_optimizer.py)"),
    # benchmarks (bench/worker.py, bench/gpu_probes.py)
    ("deepspeed.runtime.pipe.engine.PipelineEngine", "_INSTRUCTION_MAP", "timing each pipeline instruction "
     "(the engine dispatches every schedule instruction through it), and PipelineEngineExtension's own "
     "instructions"),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
     "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", "ZeRO-3's gradient partitions, counted as "
     "gradients by bench zero"),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "_muon_pending_momentum", "ZeRO 1/2's staged "
     "copy of Muon's momentum, counted as optimizer state by bench zero (plan counts it)"),
    ("torch", "_fused_sdp_choice", "which backend scaled_dot_product_attention picks (the GPU check)"),
    # export (inference/export.py), JIT builds (utils/jit_lock.py)
    ("torch.nn.Module", "_parameters", "export's cast replaces a module's tensors in place"),
    ("torch.nn.Module", "_buffers", "export's cast replaces a module's tensors in place"),
    ("torch.onnx", "_internal", "the ONNX exporter's package, whose registration logger is quieted"),
    ("torch.onnx._internal.exporter", "_registration", "its logger, quieted: it warns about operators no language "
     "model uses"),
    ("transformers.PreTrainedModel", "_keys_to_ignore_on_load_unexpected", "the checkpoint tensors from_pretrained "
     "skips (DeepSeek-V4's mtp.*): a stage-local load skips the same"),
    ("transformers.PreTrainedModel", "_keep_in_fp32_modules_strict", "the modules from_pretrained keeps in fp32, "
     "which export's cast keeps too"),
    ("torch.utils.cpp_extension", "_get_build_directory", "where JIT builds lock (torch's own rule for the "
     "extensions directory)"),
)


# ------------------------------------------------------------------------------------------ process groups
def all_process_groups() -> list[ProcessGroup]:
    """Every process group of this rank (torch lists them nowhere public)."""
    return list(distributed_c10d._world.pg_map)


def set_group_timeout(group: ProcessGroup, timeout: timedelta) -> None:
    """A group's collective timeout after it is made: DeepSpeed makes its groups without one."""
    distributed_c10d._set_pg_timeout(timeout, group)


def group_timeout_s(group: ProcessGroup) -> float:
    """A group's timeout as its backend holds it (read back, to check set_group_timeout took)."""
    return group._get_backend(group._device_types[0]).options._timeout.total_seconds()


# ------------------------------------------------------------------------------------------ torch.save
# torch.save's keyword for the zip (True) or legacy (False) format: DeepSpeed's torch engine passes its
# checkpoint_serialization setting through it, and so does the project's engine (checkpoint/io_engine.py).
TORCH_SAVE_ZIPFILE = "_use_new_zipfile_serialization"


# ------------------------------------------------------------------------------------------ patching methods
# DeepSpeedEngine methods replaced on one engine for a while (DeepSpeed offers no hook for either).
COPY_RECOVERY_SCRIPT = "_copy_recovery_script"  # copies zero_to_fp32.py etc. into the checkpoint at every save
TAKE_MODEL_STEP = "_take_model_step"  # the optimizer update: checkpoint.async's copy must finish before it
# Methods replaced on their class while deepspeed.initialize runs (parallel/expert_lora.py).
AUTOEP_REPLACE_MOE_LAYER = "_replace_moe_layer_without_retarget"  # AutoEP: one MoE block -> its AutoEPMoELayer
CONFIGURE_OPTIMIZER = "_configure_optimizer"  # DeepSpeedEngine: the (ZeRO) optimizer's construction


def replace_instance_method(obj: object, name: str, fn: Callable) -> Callable:
    """Make `fn` obj's `name` (this instance only); returns what obj.name was (the class's, bound)."""
    original = getattr(obj, name)
    setattr(obj, name, fn)
    return original


def restore_instance_method(obj: object, name: str) -> None:
    """The class's method again (a no-op when it is already)."""
    vars(obj).pop(name, None)


@contextlib.contextmanager
def instance_method_replaced(obj: object, name: str, fn: Callable) -> Iterator[Callable]:
    """replace_instance_method for the block; yields the original."""
    original = replace_instance_method(obj, name, fn)
    try:
        yield original
    finally:
        restore_instance_method(obj, name)


@contextlib.contextmanager
def attribute_replaced(owner: object, name: str, value: object) -> Iterator[None]:
    """`value` as owner's `name` for the block (a class's method: every instance's; a module's function: every
    caller's that looks it up at call time), the original again after it."""
    original = vars(owner).get(name)  # None: inherited, found on a base again once removed
    setattr(owner, name, value)
    try:
        yield
    finally:
        if original is None:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


# ------------------------------------------------------------------------------------------ DeepSpeed state
@contextlib.contextmanager
def universal_checkpoint_loading(engine) -> Iterator[None]:
    """engine.load_checkpoint reads a universal checkpoint in the block: DeepSpeed reads this config flag only
    while loading, so a run picks the loader after start-up, from the checkpoint it found."""
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False


def fused_adam_overflow_buffer(opt) -> torch.Tensor:
    """FusedAdam's multi_tensor_applier flag tensor: replaying its kernel on resume passes the one it uses."""
    return opt._dummy_overflow_buf


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """The module's own buffers that state_dict() leaves out (asked without calling state_dict(), which touches
    ZeRO-3's partitioned parameters)."""
    return module._non_persistent_buffers_set


def expert_parallel_rank(group_name: str) -> int:
    """This rank's place in an expert-parallel group (AutoEP's ep_group_name): which experts it holds."""
    return groups._get_expert_parallel_rank(group_name)


def expert_data_parallel_rank(group_name: str) -> int:
    """This rank's place among the replicas of its experts (the group of `group_name`)."""
    return groups._get_expert_data_parallel_rank(group_name)


def experts_kernel(experts) -> Callable:
    """The kernel GroupedExperts.forward runs on `experts`' settings, called (w1, w2, w3, x, tokens per expert,
    activation, alpha, limit): LoRA runs it on adapted weights (DeepSpeed exposes only forward on its own)."""
    if experts.use_triton_grouped_mm:
        return ep_experts._run_experts_triton_grouped_mm
    if experts.use_grouped_mm:
        return (ep_experts._run_experts_grouped_mm_fused_gate_up if experts.gate_up_impl == "fused"
                else ep_experts._run_experts_grouped_mm)
    return ep_experts._run_experts_for_loop




# ------------------------------------------------------------------------------------------ sequence parallelism
def sequence_all_to_all(group: ProcessGroup, t: torch.Tensor, scatter_dim: int, gather_dim: int,
                        batch_dim: int) -> torch.Tensor:
    """DeepSpeed-Ulysses' differentiable all-to-all: it reads each tensor's own head size, which MLA needs."""
    return _SeqAllToAll.apply(group, t, scatter_dim, gather_dim, batch_dim)


def attention_implementation(config) -> str:
    """transformers' attention implementation of a config (kept on the config only)."""
    return config._attn_implementation


def set_attention_implementation(config, name: str) -> None:
    """Make `name` (a transformers AttentionInterface name) what modules of `config` attend with."""
    config._attn_implementation = name


def set_experts_implementation(config, name: str) -> None:
    """Make `name` (a transformers experts kernel: grouped_mm, batched_mm, eager) what MoE modules of `config`
    run their experts with (kept on the config only, as the attention choice is)."""
    config._experts_implementation = name


# ------------------------------------------------------------------------------------------ pipeline parallelism
# PipelineModule.__init__ partitions its layers by calling this method (DeepSpeed offers no hook): the project's
# pipeline module (models/pipeline.py) overrides it with the partition it computed before construction.
PARTITION_LAYERS = "_partition_layers"


def pipeline_stage(module) -> int:
    """This rank's pipeline stage, from a PipelineModule's topology (as DeepSpeed's own partition reads it)."""
    return module._topo.get_coord(module.global_rank).pipe


def set_stage_layers(module, start: int, stop: int) -> None:
    """Make layers start .. stop - 1 (of the whole list of specs) a PipelineModule's own: its stage's bounds."""
    module._set_bounds(start=start, stop=stop)


def pipeline_data_parallel_group(module) -> ProcessGroup:
    """The data-parallel group a PipelineModule made from its topology (its grid is not public)."""
    return module._grid.get_data_parallel_group()


# ------------------------------------------------------------------------------------------ autograd, TP, JIT, export
def in_backward() -> bool:
    """Whether autograd is running a backward pass now: activation checkpointing re-runs forwards (and their hooks)
    inside it; torch.utils.checkpoint itself tells the two apart this way."""
    return torch._C._current_graph_task_id() != -1


def init_tensor_parallel_mesh(tp: int) -> None:
    """DeepSpeed's data x tensor mesh of `tp` ranks per replica, made before deepspeed.initialize (which otherwise
    counts every rank as data-parallel); HF Trainer's tp_model_init path makes it the same way."""
    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)


def torch_extensions_dir() -> str:
    """Where torch builds (and locks) JIT extensions: TORCH_EXTENSIONS_DIR, else its default, by torch's own rule."""
    return cpp_extension._get_build_directory("", verbose=False)


def own_tensor_stores(module: torch.nn.Module) -> tuple[dict, dict]:
    """A module's own (parameters by name, buffers by name), the dicts it keeps them in: a buffer stored there is
    replaced in place, with no check nor hook (nn.Module has no public setter that keeps a buffer a buffer)."""
    return module._parameters, module._buffers


def keep_in_fp32_modules(model) -> list[str]:
    """The module name patterns transformers keeps in fp32 whatever the dtype (from_pretrained(dtype=...)); none for
    a model without them."""
    return getattr(model, "_keep_in_fp32_modules_strict", None) or []


def keys_ignored_on_load(model) -> list[str]:
    """The name patterns of checkpoint tensors transformers' from_pretrained skips (e.g. DeepSeek-V4's `mtp.*`)."""
    return list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


# The ONNX exporter's operator registration logs here (warnings about operators no language model uses).
ONNX_REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"


# ------------------------------------------------------------------------------------------ benchmarks
# ZeRO-3's per-parameter gradient partitions (a name-mangled field): bench zero counts them as gradients.
ZERO3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
# ZeRO 1/2's copy of Muon's momentum that a step's update is staged in until the step survives the overflow check
# (kept between steps, out of optimizer.state): per group, (staged buffer, flat master partition).
ZERO12_MUON_STAGED_MOMENTUM = "_muon_pending_momentum"


def pipeline_instructions(engine_cls) -> dict:
    """A copy of the pipeline engine's instruction -> method table (PipelineEngine._INSTRUCTION_MAP), to time each."""
    return dict(engine_cls._INSTRUCTION_MAP)


def set_pipeline_instructions(engine, table: dict) -> None:
    """`table` as this engine's instruction table (an instance copy shadows the class's)."""
    engine._INSTRUCTION_MAP = table


def sdpa_backend_choice(q, k, v, attn_mask, dropout_p: float, is_causal: bool) -> int:
    """The backend torch's scaled_dot_product_attention would pick for these inputs (an SDPBackend value)."""
    return torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal)
