"""train.objective grpo: GRPO on a prompts dataset (DeepSeekMath, DeepSeek-R1), as TRL's GRPOTrainer with one update
per generation. A step: this rank's prompts (train.global_batch_size counts completions, num_generations per prompt),
their rollouts (grpo_rollout.py), then the loss of models/grpo_loss.py over micro-batches of completions. The
reference (grpo.beta > 0) is the starting model: the base with its adapters off under LoRA, else a frozen copy."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...data import GlobalBatchSampler, sample_count
from ...models.registry import family_of
from ...models.router_replay import RouterReplay
from ..evaluation import eval_sample_count, task_scores_run
from ..run import Run
from ..whole_model import whole_copy
from .base import Objective
from .dpo_reference import adapters_off, buffer_copies
from .grpo_rollout import Rollouts, make_rollouts, sample_completions, score

PAD = 0  # the token id right-padding the rows (causal attention: real tokens never see it, no loss reads it)


class GRPO(Objective):
    name = "grpo"

    def __init__(self):
        # The reference with grpo.beta > 0: a frozen copy of the starting model, or under LoRA the base (the adapters
        # off) with its starting buffers.
        self.reference: torch.nn.Module | None = None
        self.base_buffers: list[torch.Tensor] | None = None

    def sampler(self, run: Run, consumed_samples: int = 0) -> GlobalBatchSampler:
        """Prompts, not completions: a global batch holds global_batch_size / num_generations of them, each rank
        whole groups (one micro-batch of its prompts)."""
        t, prompts = run.cfg.train, run.cfg.train.global_batch_size // run.cfg.grpo.num_generations
        return GlobalBatchSampler(sample_count(run.dataset), prompts, prompts // run.dp_size, run.dp_rank,
                                  run.dp_size, t.seed, shuffle=t.shuffle, consumed_samples=consumed_samples)

    def before_training(self, run: Run) -> None:
        if run.cfg.grpo.router_replay:
            fam, config = family_of(run.model_config), run.model_config
            run.loss_fn.replay = RouterReplay(run.engine.module, fam.score_func,
                                              bool(getattr(config, "norm_topk_prob", False)) and fam.score_func == "sigmoid",
                                              config.routed_scaling_factor, run.engine.device)
        # Before the resume: the engine still holds the starting weights.
        if run.cfg.grpo.beta != 0.0 and not run.cfg.lora.r:
            self.reference = frozen_copy(run)
        elif run.cfg.grpo.beta != 0.0:  # the base as it starts (training moves router biases, not adapters)
            self.base_buffers = buffer_copies(run.engine.module)

    def batches(self, run: Run, sampler: GlobalBatchSampler):
        """Per global batch of prompts (a generation): its rollouts, then grpo.num_iterations steps on them."""
        prompts, iterations = sampler.global_batch_size, run.cfg.grpo.num_iterations
        for micro in sampler:  # one micro-batch: this rank's prompts of the generation
            first_step = (sampler.consumed_samples // prompts - 1) * iterations + 1
            generation = self._generation(run, list(micro[0]), first_step)
            for _ in range(iterations):
                yield generation

    def stops_at(self, run: Run, step: int) -> bool:
        """At the end of a generation: a checkpoint holds no rollouts, so one inside a generation would not resume
        exactly (a stop on a signal waits for the generation's last update)."""
        return step % run.cfg.grpo.num_iterations == 0

    def local_step(self, run: Run, batch: Generation) -> torch.Tensor:
        rollouts, engine, mb = batch.rollouts, run.engine, run.cfg.train.micro_batch_size
        run.loss_fn.add_rewards(rollouts.rewards, rollouts.per_function)
        completions = torch.tensor(float(run.cfg.train.global_batch_size), dtype=torch.float64, device=engine.device)
        scale = run.layout.gradient_size * run.grad_accum
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        with run.phases.phase("update"):
            for k, (ids, starts, completion, mask) in enumerate(batch.rows):
                advantages = rollouts.advantages[k * mb:(k + 1) * mb].to(engine.device)
                with _replaying(run, rollouts, k, ids.shape[1]):
                    loss = run.loss_fn(engine(ids), completion, starts, mask, advantages, batch.ref_logps[k],
                                       completions, batch.tokens, scale, batch.old_logps[k])
                    engine.backward(loss)
                engine.step()
                total += loss.detach().double()
        return total

    def metric_parts(self, run: Run, device: torch.device) -> dict[str, torch.Tensor]:
        replay = run.loss_fn.replay
        return {"loss": run.loss_fn.take_parts(device), "phases": run.phases.take().to(device),
                **({"replay": replay.take().to(device)} if replay is not None else {})}

    def metrics(self, run: Run, parts: dict[str, list[float]]) -> dict[str, float]:
        """The loss's metrics, and time_<phase>: each phase's seconds in the step (the mean over the ranks)."""
        times = {f"time_{name}": s / run.world for name, s in zip(run.phases.names, parts["phases"])}
        return {**run.loss_fn.metrics(parts["loss"], parts.get("replay")), **times}

    def evaluate(self, run: Run, dataset) -> dict:
        """eval_reward: the mean reward of greedy completions of the validation prompts (the first eval.batches
        global batches' prompts, each rank its share; every rank calls it); eval.task's scores when the run has one."""
        cfg, prompts = run.cfg, run.cfg.train.global_batch_size // run.cfg.grpo.num_generations
        n = eval_sample_count(len(dataset), cfg.eval.batches, prompts)
        mine = list(range(run.dp_rank, n, run.dp_size))
        completions = sample_completions(run, [dataset.prompt_ids(i) for i in mine], step=0, sampled=False)
        rewards, _ = score(run, dataset, mine, completions)
        sums = torch.stack([rewards.sum(), torch.tensor(float(len(mine)), dtype=torch.float64, device=rewards.device)])
        dist.all_reduce(sums, group=run.layout.gradient_group)
        record = {"eval_reward": (sums[0] / sums[1].clamp(min=1)).item(), "eval_prompts": int(sums[1].item())}
        if cfg.eval.task:
            record.update({f"task_{k}": v for k, v in task_scores_run(run).items()})
        return record

    def validation_message(self, step: int, record: dict) -> str:
        return f"step {step}: validation reward {record['eval_reward']:.4f} ({record['eval_prompts']} prompts, greedy)"

    def loss_lines(self, records: list[dict]) -> list[str]:
        first, last = records[0], records[-1]
        return [f"  reward      {first['reward']:.4f} -> {last['reward']:.4f} (mean over each step's completions)"]

    def validation_lines(self, record: dict) -> list[str]:
        return [f"  validation  reward {record['eval_reward']:.4f} over {record['eval_prompts']} prompts, greedy "
                f"(step {record['step']})"]

    def _generation(self, run: Run, prompt_index: list[int], step: int) -> Generation:
        """Rollouts of `prompt_index` sampled at `step` (the generation's first), the reference's log-probabilities once
        for all its updates, and with num_iterations > 1 the sampling policy's (TRL's old_per_token_logps)."""
        engine, mb = run.engine, run.cfg.train.micro_batch_size
        with run.phases.phase("generation"):  # sampling and scoring
            rollouts = make_rollouts(run, prompt_index, step)
            rows = [_rows(rollouts.prompt_ids[a:a + mb], rollouts.completion_ids[a:a + mb], engine.device)
                    for a in range(0, len(rollouts.completion_ids), mb)]
            tokens = sum(mask.sum() for _, _, _, mask in rows).double()
            dist.all_reduce(tokens, group=run.layout.gradient_group)
            old = [None] * len(rows)
            if run.cfg.grpo.num_iterations > 1:
                with torch.no_grad():
                    for k, (ids, starts, completion, _) in enumerate(rows):
                        with _replaying(run, rollouts, k, ids.shape[1]):
                            old[k] = run.loss_fn.logps(engine(ids), completion, starts)
        with run.phases.phase("reference"):
            ref = [self._reference_logps(run, ids, completion, starts) for ids, starts, completion, _ in rows]
        return Generation(rollouts, rows, ref, old, tokens)

    def _reference_logps(self, run: Run, ids: torch.Tensor, completion: torch.Tensor,
                         starts: torch.Tensor) -> torch.Tensor | None:
        """The reference's log-probabilities of the completion tokens (None with grpo.beta 0)."""
        if run.cfg.grpo.beta == 0.0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return run.loss_fn.logps(self.reference(ids), completion, starts)
            with adapters_off(run.engine.module, self.base_buffers):
                return run.loss_fn.logps(run.engine(ids), completion, starts)


@dataclass
class Generation:
    """This rank's rollouts of one generation and what every update on them reads: each micro-batch's rows (ids,
    starts, completion, mask), the reference's and, with num_iterations > 1, the sampling policy's log-probabilities
    (None each otherwise), and the global batch's completion tokens."""
    rollouts: Rollouts
    rows: list[tuple]
    ref_logps: list[torch.Tensor | None]
    old_logps: list[torch.Tensor | None]
    tokens: torch.Tensor


@contextlib.contextmanager
def _replaying(run: Run, rollouts: Rollouts, k: int, width: int):
    """With router replay, the forwards of micro-batch k route each token as its sampling did."""
    if rollouts.routing is None:
        yield
        return
    mb = run.cfg.train.micro_batch_size
    run.loss_fn.replay.replaying(rollouts.routing[k * mb:(k + 1) * mb], width)
    try:
        yield
    finally:
        run.loss_fn.replay.replaying(None)


def _rows(prompts: list[list[int]], completions: list[list[int]], device):
    """(input ids [B, W] as [prompt | completion | padding], each completion's first column [B] (host), completion
    ids [B, T] and their mask [B, T]) of a micro-batch."""
    width = max(len(c) for c in completions)
    starts = torch.tensor([len(p) for p in prompts])
    ids = torch.full((len(prompts), int(starts.max()) + width), PAD, dtype=torch.long)
    completion = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, :len(p) + len(c)] = torch.tensor(p + c)
        completion[r, :len(c)] = torch.tensor(c)
        mask[r, :len(c)] = True
    return ids.to(device), starts, completion.to(device), mask.to(device)


def frozen_copy(run: Run) -> torch.nn.Module:
    """The starting model, frozen, whole on every rank: the reference of a full fine-tune (whole_model.py)."""
    return whole_copy(run).eval().requires_grad_(False)
