"""Resuming: every rank loads the newest complete checkpoint of checkpoint.dir, natively when the layout is the
saved one, else resharded through a universal checkpoint, and refuses checkpoints of another model or tokenizer
or a layout change DeepSpeed cannot make."""

from __future__ import annotations

import logging
import os
import re
import shutil

import psutil
import torch.distributed as dist

from ..data import dataset_info
from ..models.muon import is_muon
from ..parallel.degrees import Layout
from ..utils.private_api import universal_checkpoint_loading
from .format import (
    PARTIAL,
    CheckpointError,
    check_compatible,
    check_lora_compatible,
    complete_tags,
    current_layout,
    read_meta,
    saved_layout,
)
from .integrity import check_tag, damaged_warning
from .io_engine import loading, verifies_loads
from .muon_universal import restore_momentum
from .run import TrainingRun
from .safe_load import trusted_types_only
from .state import replay_cpu_adam_steps, restore_buffers, restore_expert_adapters, restore_rng
from .universal import convert_on_rank0
from .verified_load import VerifiedLoads


def resume(run: TrainingRun, below: str | None = None) -> dict | None:
    """Every rank calls this before training. Loads the newest complete checkpoint of checkpoint.dir that verifies
    (resharding it when the layout changed) and returns {"step", "consumed_samples", "schedule_steps"} (the length
    of the checkpoint's LR schedule), "tag"; None for a fresh run. `below`: only tags older than this one (the
    fallback from a damaged one), each verified in full before it is loaded.

    The newest tag is chosen on its files' sizes; a native load checksums its files as it reads them
    (verified_load.py), a resharding one verifies them first. A damaged tag is loaded over by the next older one."""
    ckpt_dir = run.cfg.checkpoint_dir
    tag, refusal = _choose(run, sizes_only=below is None, below=below)
    if refusal:
        raise CheckpointError(refusal)
    if run.rank == 0 and below is None:
        _remove_partials(ckpt_dir, run.log)
    if tag is None:
        return None
    tag_dir = os.path.join(ckpt_dir, tag)
    meta = read_meta(tag_dir)
    check_compatible(tag_dir, meta, run.model_config, dataset_info(run.dataset_dir)["tokenizer_hash"])
    check_lora_compatible(tag_dir, meta, run.cfg.lora)
    saved, now = saved_layout(meta), current_layout(run)
    engine = run.engine
    with trusted_types_only():
        if _loads_natively(saved, now):
            verified = VerifiedLoads(tag_dir) if below is None and verifies_loads(engine) else None
            # A LoRA checkpoint's model states lack the frozen base, which build_run loaded from model.path.
            with loading(engine, engine.module, verified):
                path, _ = engine.load_checkpoint(ckpt_dir, tag=tag, load_module_strict=run.cfg.lora.r == 0)
            if path is None:
                raise CheckpointError(f"DeepSpeed found no model states in {tag_dir}; resume from another step")
            problem = verified.problem(run.rank, run.world) if verified else None
            if problem:
                return _damaged(run, tag_dir, problem)
            restore_expert_adapters(run, tag_dir)
        else:
            if below is None and (problem := _tag_problem(run, tag_dir, sizes_only=False)):
                return _damaged(run, tag_dir, problem)  # before a conversion reads the whole tag
            _check_reshardable(tag_dir, saved, now, run.cfg.lora.r)
            if run.rank == 0:
                run.log.info("layout changed (%s -> %s): resuming %s through a universal checkpoint",
                             saved.describe(), now.describe(), tag)
            _load_universal(run, tag_dir)
    replay_cpu_adam_steps(run.engine.basic_optimizer)
    if not restore_rng(tag_dir, run.rank):  # a rank the saving layout did not have
        run.log.info("rank %d: no RNG state in %s; keeping this run's seeded state", run.rank, tag_dir)
    sched = meta["deepspeed_config"].get("scheduler", {}).get("params", {})
    return {"step": int(meta["step"]), "consumed_samples": int(meta["consumed_samples"]),
            "schedule_steps": sched.get("total_num_steps"), "tag": tag}


def _damaged(run: TrainingRun, tag_dir: str, problem: str) -> dict | None:
    """A tag found damaged as it was loaded: warn, then resume from an older one (its load replaces all this one's
    state: weights, optimizer, schedule, RNG)."""
    if run.rank == 0:
        run.log.warning(damaged_warning(tag_dir, problem))
    return resume(run, below=os.path.basename(tag_dir))


def _choose(run: TrainingRun, sizes_only: bool, below: str | None) -> tuple[str | None, str | None]:
    """(the tag to resume from, None) or (None, why not), the same on every rank: the newest complete tag (older than
    `below`) that verifies on every rank, its sizes only or its checksums too, skipping damaged ones with a warning
    naming the bad file. Checkpoints that are all damaged are refused rather than silently replaced by a fresh run."""
    ckpt_dir = run.cfg.checkpoint_dir
    listed = [complete_tags(ckpt_dir) if run.rank == 0 else None]  # one list, whatever each host's cache shows
    dist.broadcast_object_list(listed, src=0)
    older = [t for t in listed[0] if below is None or t < below]  # step tags: zero-padded, so in step order
    for tag in reversed(older):
        problem = _tag_problem(run, os.path.join(ckpt_dir, tag), sizes_only)
        if problem is None:
            return tag, None
        if run.rank == 0:
            run.log.warning(damaged_warning(os.path.join(ckpt_dir, tag), problem))
    if listed[0]:
        return None, (f"no checkpoint in {ckpt_dir} verifies (`deepseek-ds checkpoint verify {ckpt_dir}` lists what "
                      "is damaged); restore one from a copy, or move the directory away to start a fresh run")
    return None, None


def _tag_problem(run: TrainingRun, tag_dir: str, sizes_only: bool) -> str | None:
    """The first problem any rank finds in the tag: every rank checks the sizes and checksums its share of the files
    (integrity.py), so a large tag costs each rank 1/world of its bytes, not rank 0 all of them."""
    problems = [None] * run.world
    dist.all_gather_object(problems, check_tag(tag_dir, sizes_only=sizes_only, part=(run.rank, run.world)).problem)
    return next((p for p in problems if p), None)


def _loads_natively(saved: Layout, now: Layout) -> bool:
    """DeepSpeed's own files fit: the same layout to them, or ZeRO-0 on another data-parallel size (without ZeRO every
    rank holds the whole optimizer state of its pipeline stage)."""
    same_pipeline = (saved.pipeline_stages, saved.pipeline_parts) == (now.pipeline_stages, now.pipeline_parts)
    return saved.same_files(now) or (saved.zero_stage == now.zero_stage == 0 and saved.precision == now.precision
                            and same_pipeline and saved.expert_parallel == now.expert_parallel
                            and saved.tensor_parallel == now.tensor_parallel)


def _check_reshardable(tag_dir: str, saved: Layout, now: Layout, lora_r: int) -> None:
    fix = ("resume with the saved layout, or `deepseek-ds export hf` it and start a new run from the export "
           "with model.path")
    if lora_r:
        # The universal loader loads strictly (the checkpoint lacks the frozen base) and does not map adapter names.
        raise CheckpointError(f"checkpoint {tag_dir} ({saved.describe()}) cannot be resumed as {now.describe()}: a "
                              f"LoRA checkpoint holds only adapters, which DeepSpeed's universal checkpoints do not "
                              f"reshard; {fix}")
    if saved.tensor_parallel != now.tensor_parallel and now.tensor_parallel != 1:
        raise CheckpointError(f"checkpoint {tag_dir} ({saved.describe()}) cannot be resumed as {now.describe()}: "
                              f"parallel.tensor_parallel = {now.tensor_parallel} but the checkpoint was trained with "
                              f"{saved.tensor_parallel}, and a tensor-parallel checkpoint is resharded only to "
                              f"tensor_parallel = 1; set parallel.tensor_parallel = {saved.tensor_parallel} or 1, or "
                              "`deepseek-ds export hf` it and start a new run from the export with model.path")
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


def _remove_partials(ckpt_dir: str, log: logging.Logger) -> None:
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        if PARTIAL.match(name):
            # A universal conversion's partial names its process (universal.to_universal): an eval converting now.
            converter = re.match(r"^\..+\.(\d+)\.partial$", name)
            if converter and psutil.pid_exists(int(converter.group(1))):
                continue
            log.info("removing %s: a save or conversion that did not finish", os.path.join(ckpt_dir, name))
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


def _load_universal(run: TrainingRun, tag_dir: str) -> None:
    universal = convert_on_rank0(tag_dir, current_layout(run).scheme, run.model_config, run.rank)
    engine = run.engine
    # DeepSpeed reads its `load_universal` config flag only while loading; setting it here (rather than in the
    # DeepSpeed JSON) lets a run decide after start-up, from the checkpoint found, which loader to use.
    with universal_checkpoint_loading(engine):
        path, _ = engine.load_checkpoint(os.path.dirname(universal), tag=os.path.basename(universal))
    if path is None:
        raise CheckpointError(f"DeepSpeed found no model states in {universal}; delete it to convert again")
    if is_muon(run.ds):
        restore_momentum(engine, universal)
    restore_buffers(run, tag_dir)
