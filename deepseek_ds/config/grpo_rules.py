"""validate()'s rules for train.objective grpo: the data it needs (a prompts dataset, and no other objective on one),
the batch arithmetic of groups, the reward functions, and the layouts generation cannot run in yet."""

from __future__ import annotations

import os

from ..data import DataError, dataset_info
from ..data.layout import PROMPTS_FORMAT, dataset_format
from ..rewards import BUILTINS, RewardError, resolve_rewards
from .schema import RunConfig


def grpo_errors(cfg: RunConfig, ds: dict, world_size: int, files: bool = True) -> list[str]:
    """train.objective against a prompts dataset, then (grpo) the groups, the rewards and the layout. files=False
    (`deepseek-ds plan`) leaves out the dataset and the reward files."""
    grpo, g = cfg.train.objective == "grpo", cfg.grpo
    errors = _prompts_data_errors(cfg, grpo) if files else []
    if not grpo:
        return errors
    t, p = cfg.train, cfg.parallel
    if t.global_batch_size % g.num_generations:
        errors.append(f"train.global_batch_size = {t.global_batch_size} counts completions and must be divisible by "
                      f"grpo.num_generations = {g.num_generations} (whole groups of one prompt): set it to a multiple "
                      f"of {g.num_generations}")
    else:
        prompts, replicas = t.global_batch_size // g.num_generations, cfg.data_parallel_size(world_size)
        if prompts % replicas:
            errors.append(f"train.global_batch_size / grpo.num_generations = {prompts} prompts a step do not divide "
                          f"over the {replicas} data-parallel ranks (each generates whole groups for its own "
                          f"prompts): make the prompts a step a multiple of {replicas}")
    split = {"pipeline_stages": p.pipeline_stages, "tensor_parallel": p.tensor_parallel,
             "sequence_parallel": p.sequence_parallel}
    named = ", ".join(f"parallel.{k} = {v}" for k, v in split.items() if v > 1)
    if named:
        errors.append(f"train.objective grpo generates its rollouts with the whole model on every rank, but {named}: "
                      "set them to 1 (ZeRO-3 shards the model instead; expert parallelism gathers the experts for it)")
    if p.expert_parallel > 1 and cfg.lora.r:
        errors.append(f"train.objective grpo with lora.r = {cfg.lora.r} and parallel.expert_parallel = "
                      f"{p.expert_parallel}: the rollouts' model is gathered from AutoEP's experts without their "
                      "adapters; set parallel.expert_parallel = 1 for LoRA (or lora.r = 0)")
    if g.num_iterations > 1:  # a checkpoint holds no rollouts: it must fall between generations
        for field, value in (("train.steps", t.steps), ("checkpoint.interval", cfg.checkpoint.interval)):
            if value % g.num_iterations:
                errors.append(f"{field} = {value} with grpo.num_iterations = {g.num_iterations}: checkpoints are taken "
                              f"between generations (each has {g.num_iterations} updates), so it must be a multiple "
                              f"of {g.num_iterations}")
    if files:
        try:
            resolve_rewards(g.reward, g.reward_weights)
        except RewardError as e:
            errors.append(str(e))
    return errors


def _prompts_data_errors(cfg: RunConfig, grpo: bool) -> list[str]:
    """A prompts dataset for grpo and for grpo only; prompts the built-in rewards cannot score (no answer)."""
    if grpo and not cfg.data.path:
        return ["train.objective grpo needs data.path: a dataset from `deepseek-ds data prepare --format prompts` "
                "(not data.blend or the built-in corpus)"]
    if not cfg.data.path or not os.path.isfile(os.path.join(cfg.data.path, "meta.json")):
        return []  # no dataset, or none there: _data_errors says so
    try:
        info = dataset_info(cfg.data.path)
    except DataError:
        return []  # the dataset's own problem, reported by _data_errors
    fmt = dataset_format(info)
    if grpo and fmt != PROMPTS_FORMAT:
        return [f"train.objective is grpo but data.path {cfg.data.path!r} is a {fmt} dataset, not a prompts dataset: "
                "prepare one with `deepseek-ds data prepare --format prompts`, or set train.objective: lm"]
    if not grpo and fmt == PROMPTS_FORMAT and cfg.train.objective != "dpo":  # dpo: refused as not a preference set
        return [f"data.path {cfg.data.path!r} is a prompts dataset (RL prompts, nothing to train on): set "
                "train.objective: grpo, or prepare the data with --format chat for next-token training"]
    if not grpo:
        return []
    splits = ("train", "valid") if cfg.eval.interval else ("train",)  # held-out prompts are scored too
    unanswered = sum(info.get("unanswered", {}).get(split, 0) for split in splits)
    needs = [r for r in cfg.grpo.reward if r in BUILTINS]
    if unanswered and needs:
        return [f"grpo.reward {needs[0]} compares each completion with its prompt's answer, but {unanswered} prompts "
                f"of data.path {cfg.data.path!r} ({' and '.join(splits)} split{'s' * (len(splits) > 1)}) have none: give every prompt record "
                "an 'answer', or use a reward function of your own (path/to/file.py:function)"]
    return []
