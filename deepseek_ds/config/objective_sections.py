"""The run YAML's sections of the objectives beyond next-token training: `preference` (train.objective dpo) and
`grpo` (train.objective grpo). Each checks its own fields as schema.py's sections do; the rules that need other
sections are in validate.py and grpo_rules.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import refuse

PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo")
GRPO_LOSSES = ("grpo", "dapo", "dr_grpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class PreferenceSection:
    """train.objective dpo (models/preference_loss.py has the formulas, TRL's)."""
    loss: str = "sigmoid"
    """sigmoid (DPO), ipo, or simpo (reference-free, length-normalised)."""
    beta: float = 0.1
    """How far the policy may move from the reference (DPO/IPO); SimPO's reward scale."""
    label_smoothing: float = 0.0
    """Conservative DPO: the chance a preference label is wrong (sigmoid and simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (the loss uses gamma / beta)."""
    rpo_alpha: float = 0.0
    """RPO: add rpo_alpha x the chosen response's per-token mean negative log-likelihood to each pair's loss, which
    keeps the chosen answers likely (DPO alone may lower both); 0: off."""
    reference: str | None = None
    """The reference model, an HF directory of the policy's architecture and vocabulary; null: the starting weights.
    Its log-probabilities are computed once before training and stored beside the checkpoints."""

    def __post_init__(self):
        problems = []
        if self.loss not in PREFERENCE_LOSSES:
            problems.append(f"preference.loss = {self.loss!r}: use 'sigmoid' (DPO), 'ipo' or 'simpo'")
        if self.beta <= 0:
            problems.append(f"preference.beta = {self.beta} must be > 0")
        if self.rpo_alpha < 0:
            problems.append(f"preference.rpo_alpha = {self.rpo_alpha} must be >= 0 (0: off)")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"preference.label_smoothing = {self.label_smoothing} must be in [0, 0.5)")
        refuse(problems)


@dataclass
class GrpoSection:
    """train.objective grpo: RL on a `--format prompts` dataset with verifiable rewards (DeepSeek-R1's GRPO); defaults
    and meanings as TRL's GRPOConfig. train.global_batch_size counts completions: global_batch_size /
    num_generations prompts a step."""
    num_generations: int = 8
    """G: completions sampled per prompt, the group whose rewards make each one's advantage (at least 2)."""
    max_completion_length: int = 512
    """Most tokens generated per completion (a completion ends earlier at the tokenizer's EOS)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probabilities sum to top_p; 1.0: all tokens."""
    beta: float = 0.0
    """KL coefficient to the reference (the starting weights); 0.0: no reference pass. DeepSeek-R1 used 0.001."""
    epsilon: float = 0.2
    """Clipping: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = None
    """The upper clipping epsilon; null: epsilon (DAPO recommends 0.28)."""
    loss_type: str = "dapo"
    """How token losses are aggregated: grpo (each sequence's mean, then the mean over sequences), dapo (over all
    completion tokens of the global batch) or dr_grpo (over completions x max_completion_length)."""
    importance_sampling_level: str = "token"
    """token: one ratio per token; sequence: the sequence's mean log-ratio for each token (GSPO)."""
    num_iterations: int = 1
    """Optimizer updates per batch of rollouts (mu), each a training step; from the second on, the ratio to the
    sampling policy moves and clipping acts. train.steps and checkpoint.interval are multiples of it."""
    scale_rewards: str = "group"
    """Advantages (r - mean of the prompt's group) divided by the std of the group (group), of the whole batch (batch),
    or not divided (none, as Dr. GRPO recommends)."""
    reward: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions: exact_match (the completion equals the prompt's answer, whitespace stripped), math
    (math-verify: mathematically equal to the answer) or path/to/file.py:function, called as function(prompts,
    completions, answers) -> list[float] on the decoded strings."""
    reward_weights: list[float] | None = None
    """One weight per reward function (the reward is their weighted sum); null: 1.0 each."""
    router_replay: bool = False
    """MoE: record each token's experts in the rollout and replay them in the training forward (R3)."""
    rollouts: str = "rollouts.jsonl"
    """File in train.output_dir that each step's rollouts are appended to, one JSON row per completion."""

    def __post_init__(self):
        problems = []
        if self.num_generations < 2:
            problems.append(f"grpo.num_generations = {self.num_generations} must be >= 2 (advantages compare the "
                            "completions of one prompt)")
        if self.max_completion_length < 1:
            problems.append(f"grpo.max_completion_length = {self.max_completion_length} must be >= 1")
        if not self.temperature > 0:
            problems.append(f"grpo.temperature = {self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"grpo.top_p = {self.top_p} must be in (0, 1] (1.0: all tokens)")
        if self.beta < 0:
            problems.append(f"grpo.beta = {self.beta} must be >= 0 (0: no KL term)")
        if not self.epsilon > 0:
            problems.append(f"grpo.epsilon = {self.epsilon} must be > 0")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            problems.append(f"grpo.epsilon_high = {self.epsilon_high} must be > 0, or null for grpo.epsilon")
        if self.loss_type not in GRPO_LOSSES:
            problems.append(f"grpo.loss_type = {self.loss_type!r}: use 'grpo', 'dapo' or 'dr_grpo'")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            problems.append(f"grpo.importance_sampling_level = {self.importance_sampling_level!r}: use 'token' or "
                            "'sequence' (GSPO)")
        if self.num_iterations < 1:
            problems.append(f"grpo.num_iterations = {self.num_iterations} must be >= 1")
        if self.scale_rewards not in SCALE_REWARDS:
            problems.append(f"grpo.scale_rewards = {self.scale_rewards!r}: use 'group', 'batch' or 'none'")
        if not self.reward or not all(isinstance(r, str) and r for r in self.reward):
            problems.append(f"grpo.reward = {self.reward!r}: list one or more reward functions, e.g. [exact_match], "
                            "[math] or [path/to/file.py:function]")
        if self.reward_weights is not None and not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                       for w in self.reward_weights):
            problems.append(f"grpo.reward_weights = {self.reward_weights!r}: list numbers, one per grpo.reward entry")
        elif self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            problems.append(f"grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.reward)} reward "
                            "functions: give one weight per grpo.reward entry, or null for 1.0 each")
        if not self.rollouts or "/" in self.rollouts or self.rollouts in (".", ".."):
            problems.append(f"grpo.rollouts = {self.rollouts!r} must be a file name (it is written in "
                            "train.output_dir), e.g. rollouts.jsonl")
        refuse(problems)
