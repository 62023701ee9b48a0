"""GRPO's rollouts: each rank samples num_generations completions of each of its prompts from the model being trained
(a transformers view of the engine's weights, evaluation.generation_model), scores them with the reward functions and
turns the rewards into advantages; rank 0 appends every completion to the rollouts file. The sampling is seeded by
(train.seed, step, data-parallel rank), so a resumed run draws the same rollouts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ...models.grpo_loss import group_advantages
from ...models.router_replay import RoutingRecorder
from ..evaluation import generate_batch, generation_model
from ..run import Run


@dataclass
class Rollouts:
    """This rank's completions of one step, num_generations consecutive ones per prompt."""
    prompt_index: list[int]            # the dataset index of each completion's prompt
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]    # through its first EOS (which it is trained to emit), or max_completion_length
    rewards: torch.Tensor              # [n] float64, the weighted sum of the functions'
    per_function: torch.Tensor         # [F, n] float64
    advantages: torch.Tensor           # [n] fp32
    routing: list[dict] | None = None  # grpo.router_replay: each completion's experts per MoE layer while sampled


def rollout_seed(seed: int, step: int, dp_rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, dp_rank]).generate_state(1)[0])


def sample_completions(run: Run, prompts: list[list[int]], step: int, sampled: bool = True,
                       routing: list | None = None) -> list[list[int]]:
    """num_generations completions of each prompt (greedy, once each, when not `sampled`), micro_batch_size rows
    generated together; `routing` (a list) gets each row's experts per MoE layer (router_replay.RoutingRecorder)."""
    g, cfg = run.cfg.grpo, run.cfg
    eos = run.tokenizer.eos_token_id
    pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else eos
    rows = [p for p in prompts for _ in range(g.num_generations)] if sampled else list(prompts)
    # top_k 0: transformers' generation default of 50 off, as TRL samples.
    sampling = {"temperature": g.temperature, "top_p": g.top_p, "top_k": 0} if sampled else None
    devices = [run.engine.device] if run.engine.device.type == "cuda" else []
    out: list[list[int]] = []
    with generation_model(run) as model, torch.random.fork_rng(devices=devices):
        recorder = RoutingRecorder(model) if routing is not None else None
        torch.manual_seed(rollout_seed(cfg.train.seed, step, run.dp_rank))
        for start in range(0, len(rows), cfg.train.micro_batch_size):
            chunk = rows[start:start + cfg.train.micro_batch_size]
            out += generate_batch(model, chunk, g.max_completion_length, pad, eos, sampling, keep_eos=True)
            if recorder is not None:
                routing += recorder.take(chunk, out[start:])
    return out


def score(run: Run, dataset, prompt_index: list[int], completion_ids: list[list[int]]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [n] float64, each function's [F, n]) of the completions of `dataset`'s prompts `prompt_index`, on the
    decoded text."""
    prompts = [dataset.prompt_text(i) for i in prompt_index]
    answers = [dataset.answer(i) for i in prompt_index]
    completions = [run.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    total, per_function = run.rewards.score(prompts, completions, answers)
    device = run.engine.device
    return (torch.tensor(total, dtype=torch.float64, device=device),
            torch.tensor([per_function[name] for name in run.rewards.names], dtype=torch.float64, device=device))


def make_rollouts(run: Run, prompt_index: list[int], step: int) -> Rollouts:
    """This rank's rollouts of `step` (every rank calls it: the batch statistics are the global batch's)."""
    g = run.cfg.grpo
    prompt_ids = [run.dataset.prompt_ids(i) for i in prompt_index]
    routing = [] if g.router_replay else None
    completions = sample_completions(run, prompt_ids, step, routing=routing)
    index = [i for i in prompt_index for _ in range(g.num_generations)]
    rewards, per_function = score(run, run.dataset, index, completions)
    batch_std = None
    if g.scale_rewards == "batch":  # the global batch's std (unbiased), from the ranks' sums
        sums = torch.stack([rewards.sum(), (rewards ** 2).sum(), torch.tensor(float(len(rewards)),
                                                                             dtype=torch.float64, device=rewards.device)])
        dist.all_reduce(sums, group=run.layout.gradient_group)
        total, squares, n = sums
        batch_std = ((squares - total * total / n) / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
    advantages, _ = group_advantages(rewards, g.num_generations, g.scale_rewards, batch_std)
    rollouts = Rollouts(index, [prompt_ids[k // g.num_generations] for k in range(len(index))], completions, rewards,
                        per_function, advantages.float(), routing)
    _write(run, step, rollouts)
    return rollouts


def _write(run: Run, step: int, r: Rollouts) -> None:
    """Rank 0 appends every rank's completions of the step to train.output_dir/<grpo.rollouts>, one JSON row each."""
    rows = [{"step": step, "prompt_index": p, "prompt_ids": pi, "completion_ids": c, "reward": rw,
             **{f"reward/{name}": f[k] for name, f in zip(run.rewards.names, r.per_function.tolist())},
             "advantage": a}
            for k, (p, pi, c, rw, a) in enumerate(zip(r.prompt_index, r.prompt_ids, r.completion_ids,
                                                      r.rewards.tolist(), r.advantages.tolist()))]
    everyone = [None] * dist.get_world_size(run.layout.gradient_group)
    dist.all_gather_object(everyone, rows, group=run.layout.gradient_group)
    if run.rank == 0:
        with open(os.path.join(run.cfg.train.output_dir, run.cfg.grpo.rollouts), "a") as f:
            f.writelines(json.dumps(row) + "\n" for part in everyone for row in part)
