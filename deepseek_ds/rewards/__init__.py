"""Reward functions for RL (train.objective grpo): the built-ins (exact_match, math) and a user's own
`path/to/file.py:function`, resolved from grpo.reward before launch and scored on decoded strings during the run.

Imports stay light (no torch, no sympy): config's validation resolves the specs before any process starts."""

from .builtin import BUILTINS, exact_match, math_match, normalize_answer
from .resolve import RewardError, RewardFunctions, resolve_rewards

__all__ = ["BUILTINS", "RewardError", "RewardFunctions", "exact_match", "math_match", "normalize_answer",
           "resolve_rewards"]
