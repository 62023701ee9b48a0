"""Checkpoints that survive anything: atomic save, retention, automatic resume (resharded through DeepSpeed
universal checkpoints when the parallel layout changed), refusal of foreign checkpoints, stop on a signal.

On disk, under `checkpoint.dir`:

  latest                  the newest complete tag, replaced atomically (os.replace) after it is published
  step00000200/           a complete checkpoint: only ever created by renaming a finished `.partial` directory
    *_model_states.pt, *_optim_states.pt, layer_*-model_states.pt    DeepSpeed's own files
    checkpoint.json       our metadata: step, consumed samples, layout, model fingerprint, tokenizer hash,
                          resolved run + DeepSpeed config (written last, by rank 0, after a barrier)
    config.json           the transformers model config (what `export hf` rebuilds the model from)
    rng/rank_00000.pt     RNG states of every rank (python, numpy, torch, accelerator)
    buffers/stage_00.safetensors   persistent buffers (MoE e_score_correction_bias) by HF name: a universal
                          checkpoint holds only parameters, so a resharded resume restores buffers from here
  .step00000300.partial/  a save in progress or killed mid-way: never read, removed on the next resume
  step00000200.universal-sequential/   the universal conversion of a tag for another layout (a cache)

File names inside a tag directory must not start with DeepSpeed's prefixes (mp_rank_, layer_, zero_pp_rank_):
its universal converter collects files recursively by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .utils.fs import write_bytes_atomic, write_json_atomic

FORMAT_VERSION = 1
META = "checkpoint.json"
MODEL_CONFIG = "config.json"
LATEST = "latest"
_TAG = re.compile(r"^step(\d{8,})$")
_PARTIAL = re.compile(r"^\..+\.partial$")
# transformers config fields that do not change the weights or the math of a forward pass.
_NOT_MODEL_FIELDS = {"transformers_version", "architectures", "output_hidden_states", "output_attentions",
                     "return_dict", "dtype", "torch_dtype", "use_cache", "id2label", "label2id", "problem_type",
                     "chunk_size_feed_forward", "output_router_logits"}
# The two containers name parameters differently (see checkpoint_universal): SequentialLM, DeepSeekPipelineModule.
SEQUENTIAL, PIPELINE = "sequential", "pipeline"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the checkpoint, the mismatch and the fix."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


# ----------------------------------------------------------------------------------------------- safe loading
_trusted_depth = 0  # open trusted_types_only() contexts in this process


@contextlib.contextmanager
def trusted_types_only():
    """Inside, every torch.load runs the weights-only unpickler, DeepSpeed's own included: DeepSpeed loads its
    checkpoint files with weights_only=False (engine.load_checkpoint, ds_to_universal, zero_to_fp32), which
    would run any pickled code in a tampered file. TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides that per call;
    besides tensors and containers only three plain DeepSpeed data types found in its files are allowed."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    global _trusted_depth
    if _trusted_depth:  # nested: leaving torch's safe_globals would drop the outer one's allowlist too
        yield
        return
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(key)
    os.environ[key] = "1"
    _trusted_depth += 1
    try:
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            yield
    finally:
        _trusted_depth -= 1
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


# ----------------------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run was split; two equal layouts can exchange DeepSpeed's native checkpoint files."""
    data_parallel: int
    pipeline_stages: int
    pipeline_parts: tuple[int, ...] | None
    zero_stage: int
    precision: str
    expert_parallel: int = 1

    @property
    def scheme(self) -> str:
        return PIPELINE if self.pipeline_stages > 1 else SEQUENTIAL

    @property
    def autoep(self) -> bool:
        """Whether DeepSpeed's AutoEP replaced the MoE blocks (it names their tensors differently)."""
        return self.expert_parallel > 1

    def describe(self) -> str:
        return (f"dp={self.data_parallel} pp={self.pipeline_stages} ep={self.expert_parallel} zero={self.zero_stage} "
                f"{self.precision}")

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        parts = d.get("pipeline_parts")
        return cls(d["data_parallel"], d["pipeline_stages"], tuple(parts) if parts else None, d["zero_stage"],
                   d["precision"], d.get("expert_parallel", 1))


def saved_layout(meta: dict) -> Layout:
    """The layout of a checkpoint. Checkpoints written before the layout recorded expert parallelism have it in
    their run config."""
    layout = dict(meta["layout"])
    layout.setdefault("expert_parallel", meta["run_config"].get("parallel", {}).get("expert_parallel", 1))
    return Layout.from_dict(layout)


def current_layout(run) -> Layout:
    engine = run.engine
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    parts = tuple(int(p) for p in engine.module.parts) if run.pipeline else None
    return Layout(run.dp_size, run.cfg.parallel.pipeline_stages, parts, int(engine.zero_optimization_stage()),
                  precision, run.cfg.parallel.expert_parallel)


def model_fingerprint(config) -> dict:
    """The transformers config fields that define the model, JSON-normalised so saved and live ones compare."""
    d = json.loads(config.to_json_string(use_diff=False))
    return {k: v for k, v in sorted(d.items()) if k not in _NOT_MODEL_FIELDS and not k.startswith("_")}


# ----------------------------------------------------------------------------------------------- reading
def read_meta(tag_dir: str) -> dict:
    path = os.path.join(tag_dir, META)
    if not os.path.isfile(path):
        raise CheckpointError(f"{tag_dir} is not a complete deepseek-ds checkpoint (no {META}); pass a checkpoint "
                              "directory (its newest complete step is used) or one of its step directories")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('format_version')}, this code reads "
                              f"{FORMAT_VERSION}: use the deepseek-ds version that wrote it")
    return meta


def complete_tags(ckpt_dir: str) -> list[str]:
    """Published checkpoints, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    tags = [d for d in os.listdir(ckpt_dir) if _TAG.match(d) and os.path.isfile(os.path.join(ckpt_dir, d, META))]
    return sorted(tags, key=lambda t: int(_TAG.match(t).group(1)))


def latest_tag(ckpt_dir: str) -> str | None:
    """The checkpoint to resume from: the newest complete one. (`latest`, kept for DeepSpeed's own tools, can lag
    behind it when a process dies between publishing a checkpoint and updating the file.)"""
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def tag_dir_of(path: str) -> str:
    """A step directory: `path` itself when it holds checkpoint.json, else the checkpoint directory's newest."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    tag = latest_tag(path)
    if tag is None:
        raise CheckpointError(f"{path} holds no complete deepseek-ds checkpoint (no step*/{META}); pass the "
                              "checkpoint.dir of a training run or one of its step directories")
    return os.path.join(path, tag)


# ----------------------------------------------------------------------------------------------- saving
def save(run, step: int, consumed_samples: int) -> str:
    """Every rank calls this. Writes into `.stepN.partial`, then rank 0 publishes it by renaming it to `stepN`
    and pointing `latest` at it; a kill at any moment leaves at worst a `.partial` that resume ignores."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    cfg, engine = run.cfg, run.engine
    ckpt_dir, tag = cfg.checkpoint_dir, tag_for(step)
    partial, final = os.path.join(ckpt_dir, f".{tag}.partial"), os.path.join(ckpt_dir, tag)
    t0 = time.perf_counter()
    if run.rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    client_state = {"step": step, "consumed_samples": consumed_samples}
    if not engine.has_moe_layers:
        # ds_to_universal refuses checkpoints without it (resharding needs it); DeepSpeed's expert-parallel
        # save path writes this key itself and refuses it from the client.
        client_state[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    engine.save_checkpoint(ckpt_dir, tag=os.path.basename(partial), client_state=client_state, save_latest=False)
    _save_rng(partial, run.rank)
    if run.dp_rank == 0:
        _save_buffers(partial, run)
    dist.barrier()  # every rank's files are written
    if run.rank == 0:
        run.model_config.to_json_file(os.path.join(partial, MODEL_CONFIG))
        write_json_atomic(Path(partial) / META, _meta(run, tag, step, consumed_samples))
        _fsync_tree(partial)
        if os.path.isdir(final):  # the same step saved again (a resumed run re-reaching it): replace it
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(ckpt_dir)
        write_bytes_atomic(Path(ckpt_dir) / LATEST, tag.encode())
        _prune(ckpt_dir, cfg.checkpoint.keep)
        run.log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
    dist.barrier()  # nobody goes on (or exits) before the checkpoint is published
    return final


def _meta(run, tag: str, step: int, consumed_samples: int) -> dict:
    import deepspeed
    import transformers

    from .data import dataset_info

    return {
        "format_version": FORMAT_VERSION, "tag": tag, "step": step, "consumed_samples": consumed_samples,
        "world_size": run.world, "layout": dataclasses.asdict(current_layout(run)),
        "model_config": model_fingerprint(run.model_config),
        "tokenizer_hash": dataset_info(run.dataset_dir)["tokenizer_hash"],
        "dataset_dir": os.path.abspath(run.dataset_dir),
        "run_config": run.cfg.to_dict(), "deepspeed_config": run.ds,
        "versions": {"torch": str(torch.__version__), "deepspeed": deepspeed.__version__,
                     "transformers": transformers.__version__},
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Flush every file before the rename publishes them (the rename must not reach the disk before the data)."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(d)


def _prune(ckpt_dir: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints, with their universal conversions."""
    tags = complete_tags(ckpt_dir)
    doomed = set(tags[:-keep])
    for name in os.listdir(ckpt_dir):
        if name.split(".")[0] in doomed:
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


# ----------------------------------------------------------------------------------------------- RNG and buffers
def _save_rng(tag_dir: str, rank: int) -> None:
    from deepspeed.accelerator import get_accelerator

    name, keys, pos, gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             # as tensors and numbers: the weights-only unpickler that reads it back rejects numpy arrays
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(gauss), float(cached))}
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        state["accelerator"] = acc.get_rng_state()
    os.makedirs(os.path.join(tag_dir, "rng"), exist_ok=True)
    torch.save(state, os.path.join(tag_dir, "rng", f"rank_{rank:05d}.pt"))


def _restore_rng(tag_dir: str, rank: int) -> bool:
    from deepspeed.accelerator import get_accelerator

    path = os.path.join(tag_dir, "rng", f"rank_{rank:05d}.pt")
    if not os.path.isfile(path):
        return False
    state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    name, keys, pos, gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, gauss, cached))
    if "accelerator" in state and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(state["accelerator"])
    return True


def _local_buffers(run) -> dict[str, torch.Tensor]:
    """This rank's persistent buffers by DeepSpeed module name (walked directly: state_dict() would also touch
    ZeRO-3's partitioned parameters)."""
    out = {}
    for prefix, mod in run.engine.module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def _save_buffers(tag_dir: str, run) -> None:
    from safetensors.torch import save_file

    from .checkpoint_universal import layout_names

    layout = current_layout(run)
    names = layout_names(run.model_config, layout.scheme, layout.autoep)
    tensors = {names[k]: v.detach().cpu().contiguous() for k, v in _local_buffers(run).items() if k in names}
    stage = run.engine.stage_id if run.pipeline else 0
    os.makedirs(os.path.join(tag_dir, "buffers"), exist_ok=True)
    save_file(tensors, os.path.join(tag_dir, "buffers", f"stage_{stage:02d}.safetensors"))


def read_buffers(tag_dir: str) -> dict[str, torch.Tensor]:
    """All persistent buffers of a checkpoint by HF name (safetensors: no pickle involved)."""
    from safetensors.torch import load_file

    out = {}
    folder = os.path.join(tag_dir, "buffers")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        out.update(load_file(os.path.join(folder, name)))
    return out


def _restore_buffers(run, tag_dir: str) -> None:
    from .checkpoint_universal import layout_names

    layout = current_layout(run)
    names = layout_names(run.model_config, layout.scheme, layout.autoep)
    saved = read_buffers(tag_dir)
    with torch.no_grad():
        for key, buf in _local_buffers(run).items():
            hf = names.get(key)
            if hf is None:
                continue
            if hf not in saved:
                raise CheckpointError(f"{tag_dir}/buffers has no {hf}: the checkpoint is incomplete; resume from "
                                      "an earlier step directory")
            buf.copy_(saved[hf])


# ----------------------------------------------------------------------------------------------- resuming
def check_compatible(tag_dir: str, meta: dict, model_config, tokenizer_hash: str) -> None:
    """CheckpointError naming every difference when the checkpoint belongs to another model or tokenizer."""
    saved, now = meta["model_config"], model_fingerprint(model_config)
    problems = [f"model config {k}: checkpoint {saved.get(k)!r}, this run {now.get(k)!r}"
                for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if meta["tokenizer_hash"] != tokenizer_hash:
        problems.append(f"tokenizer hash: checkpoint {meta['tokenizer_hash'][:12]} (data {meta.get('dataset_dir')}), "
                        f"this run {tokenizer_hash[:12]}")
    if problems:
        raise CheckpointError(f"checkpoint {tag_dir} was trained with another model or tokenizer:\n  - "
                              + "\n  - ".join(problems)
                              + "\nrestore the model/data settings it was trained with, or set checkpoint.dir "
                              "to an empty directory to start a new run")


def _loads_natively(saved: Layout, now: Layout) -> bool:
    """DeepSpeed's own files fit: the same layout, or ZeRO-0 on another data-parallel size (without ZeRO every
    rank holds the whole optimizer state of its pipeline stage)."""
    same_pipeline = (saved.pipeline_stages, saved.pipeline_parts) == (now.pipeline_stages, now.pipeline_parts)
    return saved == now or (saved.zero_stage == now.zero_stage == 0 and saved.precision == now.precision
                            and same_pipeline and saved.expert_parallel == now.expert_parallel)


def _check_reshardable(tag_dir: str, saved: Layout, now: Layout) -> None:
    fix = ("resume with the saved layout, or `deepseek-ds export hf` it and start a new run from the export "
           "with model.path")
    if saved.expert_parallel != now.expert_parallel:
        # Refused, not resharded: with EP 1 and > 1 the MoE blocks are different modules (transformers' gate and fused
        # experts; AutoEP's router and grouped w1/w2/w3), which DeepSpeed's universal loader does not map onto each
        # other; between two AutoEP sizes it would restore the experts' optimizer group under the saved group name
        # (ep_size_<saved size>).
        raise CheckpointError(f"checkpoint {tag_dir} ({saved.describe()}) cannot be resumed as {now.describe()}: "
                              f"parallel.expert_parallel = {now.expert_parallel} but the checkpoint was trained with "
                              f"{saved.expert_parallel}, and DeepSpeed moves a checkpoint only between runs of the same "
                              f"expert-parallel size; set parallel.expert_parallel = {saved.expert_parallel} (the "
                              "data-parallel size and ZeRO stage may change), or `deepseek-ds export hf` it and start "
                              "a new run from the export with model.path")
    if 0 in (saved.zero_stage, now.zero_stage):
        raise CheckpointError(f"checkpoint {tag_dir} ({saved.describe()}) cannot be resumed as {now.describe()}: "
                              f"resharding goes through DeepSpeed universal checkpoints, which need ZeRO >= 1 on "
                              f"both sides; {fix}")
    if (saved.zero_stage == 3) != (now.zero_stage == 3):
        raise CheckpointError(f"checkpoint {tag_dir} ({saved.describe()}) cannot be resumed as {now.describe()}: "
                              f"DeepSpeed cannot move optimizer state between ZeRO-3 and ZeRO-1/2; {fix}")


def resume(run) -> dict | None:
    """Every rank calls this before training. Loads the newest complete checkpoint of checkpoint.dir (resharding
    it when the layout changed) and returns {"step", "consumed_samples"}; None for a fresh run."""
    ckpt_dir = run.cfg.checkpoint_dir
    choice = [latest_tag(ckpt_dir) if run.rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)  # one decision, whatever each rank's view of a network filesystem
    if run.rank == 0:
        _remove_partials(ckpt_dir, run.log)
    tag = choice[0]
    if tag is None:
        return None
    from .data import dataset_info

    tag_dir = os.path.join(ckpt_dir, tag)
    meta = read_meta(tag_dir)
    check_compatible(tag_dir, meta, run.model_config, dataset_info(run.dataset_dir)["tokenizer_hash"])
    saved, now = saved_layout(meta), current_layout(run)
    with trusted_types_only():
        if _loads_natively(saved, now):
            path, _ = run.engine.load_checkpoint(ckpt_dir, tag=tag)
            if path is None:
                raise CheckpointError(f"DeepSpeed found no model states in {tag_dir}; resume from another step")
        else:
            _check_reshardable(tag_dir, saved, now)
            if run.rank == 0:
                run.log.info("layout changed (%s -> %s): resuming %s through a universal checkpoint",
                             saved.describe(), now.describe(), tag)
            _load_universal(run, tag_dir)
    if not _restore_rng(tag_dir, run.rank):  # a rank the saving layout did not have
        run.log.info("rank %d: no RNG state in %s; keeping this run's seeded state", run.rank, tag_dir)
    return {"step": int(meta["step"]), "consumed_samples": int(meta["consumed_samples"])}


def _remove_partials(ckpt_dir: str, log) -> None:
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        if _PARTIAL.match(name):
            log.info("removing %s: a save or conversion that did not finish", os.path.join(ckpt_dir, name))
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


def _load_universal(run, tag_dir: str) -> None:
    from .checkpoint_universal import to_universal, universal_dir

    scheme = current_layout(run).scheme
    if run.rank == 0:
        to_universal(tag_dir, scheme, run.model_config)
    dist.barrier()
    universal = universal_dir(tag_dir, scheme)
    engine = run.engine
    # DeepSpeed reads its `load_universal` config flag only while loading; setting it here (rather than in the
    # DeepSpeed JSON) lets a run decide after start-up, from the checkpoint found, which loader to use.
    engine._config.load_universal_checkpoint = True
    try:
        path, _ = engine.load_checkpoint(os.path.dirname(universal), tag=os.path.basename(universal))
    finally:
        engine._config.load_universal_checkpoint = False
    if path is None:
        raise CheckpointError(f"DeepSpeed found no model states in {universal}; delete it to convert again")
    _restore_buffers(run, tag_dir)


# ----------------------------------------------------------------------------------------------- stop on signal
class StopOnSignal:
    """SIGTERM (a scheduler's preemption; the deepspeed launcher forwards it, then kills after 30 s) and SIGINT
    (Ctrl-C) only set a flag. The training loop asks `requested()` after every step; it is a collective, so all
    ranks stop after the same step, save, and exit normally. A repeated signal changes nothing: the launcher
    sends SIGTERM right after a Ctrl-C's SIGINT, and dying mid-save would waste the stop."""

    def __init__(self, device: torch.device):
        self.device = device
        self.received: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
