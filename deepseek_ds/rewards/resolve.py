"""grpo.reward specs -> RewardFunctions: a built-in name (builtin.BUILTINS) or `path/to/file.py:function`, called as
`function(prompts, completions, answers) -> list[float]` on decoded strings. A spec that does not resolve, and a
function that raises or returns anything but one number per completion, is a one-line RewardError naming it."""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from collections.abc import Callable
from numbers import Real

from ..utils.errors import UserError
from .builtin import BUILTINS

Reward = Callable[[list[str], list[str], list[str | None]], list[float]]
_FORMS = f"use {', '.join(BUILTINS)} or path/to/file.py:function"


class RewardError(UserError):
    """A reward spec that does not resolve, or a reward function that failed or returned a bad value."""


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}".rstrip(": ")


def _load_user_function(spec: str) -> Reward:
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise RewardError(f"grpo.reward {spec!r} is neither a built-in reward nor a file.py:function: {_FORMS}")
    if not os.path.isfile(path):
        raise RewardError(f"grpo.reward {spec!r}: no such file {path!r} (relative paths are from the working "
                          "directory): point it at the Python file that defines the function")
    # A name of its own per file, so that two reward files of one name do not share a module.
    module_name = "deepseek_ds_reward_" + hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: whatever it raises on import is theirs to fix
        raise RewardError(f"grpo.reward {spec!r}: importing {path} failed ({_one_line(e)}): fix the file") from e
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(f"grpo.reward {spec!r}: {path} defines no {name!r} (its functions: "
                          f"{', '.join(defined) or 'none'}): name one of them after the colon")
    if not callable(function):
        raise RewardError(f"grpo.reward {spec!r}: {name} in {path} is a {type(function).__name__}, not a function")
    return function


def _resolve(spec) -> tuple[str, Reward]:
    """(the function's name in metrics, the function)."""
    if not isinstance(spec, str) or not spec:
        raise RewardError(f"grpo.reward entry {spec!r} is not a reward spec: {_FORMS}")
    if spec in BUILTINS:
        function, package = BUILTINS[spec]
        module = package and package.replace("-", "_")
        if module and importlib.util.find_spec(module) is None:
            raise RewardError(f"grpo.reward {spec!r} needs the package {package}, which is not installed: "
                              f"pip install {package}")
        return spec, function
    if ":" not in spec:
        raise RewardError(f"grpo.reward {spec!r} is not a built-in reward: {_FORMS}")
    return spec.rpartition(":")[2], _load_user_function(spec)


class RewardFunctions:
    """The run's reward functions and their weights: `score` gives each completion's weighted total and each
    function's own rewards (keyed by `names`)."""

    def __init__(self, names: list[str], functions: list[Reward], weights: list[float]):
        self.names, self.weights, self._functions = list(names), [float(w) for w in weights], list(functions)

    def score(self, prompts: list[str], completions: list[str], answers: list[str | None]
              ) -> tuple[list[float], dict[str, list[float]]]:
        """(sum over functions of weight x reward, per completion; {name: that function's rewards})."""
        n = len(completions)
        if len(prompts) != n or len(answers) != n:
            raise ValueError(f"{len(prompts)} prompts, {n} completions and {len(answers)} answers: one of each per "
                             "completion")
        each = {name: self._call(name, function, prompts, completions, answers)
                for name, function in zip(self.names, self._functions)}
        totals = [sum(w * each[name][k] for name, w in zip(self.names, self.weights)) for k in range(n)]
        return totals, each

    @staticmethod
    def _call(name: str, function: Reward, prompts, completions, answers) -> list[float]:
        try:
            values = function(list(prompts), list(completions), list(answers))
        except Exception as e:  # noqa: BLE001 - a reward function's failure ends the run in one line naming it
            raise RewardError(f"reward function {name} failed: {_one_line(e)}") from e
        if hasattr(values, "tolist"):  # a numpy array or a torch tensor
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise RewardError(f"reward function {name} returned a {type(values).__name__}, not a list of one number "
                              "per completion")
        if len(values) != len(completions):
            raise RewardError(f"reward function {name} returned {len(values)} rewards for {len(completions)} "
                              "completions: return one number per completion")
        bad = [k for k, v in enumerate(values) if not isinstance(v, Real) or not math.isfinite(v)]
        if bad:
            raise RewardError(f"reward function {name} returned {values[bad[0]]!r} for completion {bad[0]}, not a "
                              "finite number: return a float per completion")
        return [float(v) for v in values]


def resolve_rewards(specs: list[str], weights: list[float] | None) -> RewardFunctions:
    """grpo.reward and grpo.reward_weights as RewardFunctions (weights None: 1.0 each); RewardError naming the spec
    that does not resolve, or a weights list of another length."""
    if not isinstance(specs, (list, tuple)) or not specs:
        raise RewardError("grpo.reward must list at least one reward function, e.g. [exact_match]")
    repeated = sorted({s for s in specs if list(specs).count(s) > 1})
    if repeated:
        raise RewardError(f"grpo.reward lists {repeated[0]!r} more than once: list each function once (give it a "
                          "larger grpo.reward_weights entry instead)")
    resolved = [_resolve(spec) for spec in specs]
    names = [name for name, _ in resolved]
    # Two files' functions of one name: their metrics are told apart by the whole spec.
    names = [spec if names.count(name) > 1 else name for spec, name in zip(specs, names)]
    if weights is None:
        weights = [1.0] * len(specs)
    if len(weights) != len(specs):
        raise RewardError(f"grpo.reward_weights has {len(weights)} weights for {len(specs)} reward functions "
                          f"({', '.join(names)}): give one weight per function, or null for 1.0 each")
    return RewardFunctions(names, [function for _, function in resolved], list(weights))
