"""The built-in reward functions, each `function(prompts, completions, answers) -> list[float]`: 1.0 where a
completion matches its prompt's answer, else 0.0."""

from __future__ import annotations


def normalize_answer(text: str) -> str:
    """The one normalisation exact matching uses (the eval task's exact_match and the exact_match reward): surrounding
    whitespace dropped."""
    return text.strip()


def exact_match(prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
    """1.0 where the completion equals the answer once both are normalised (normalize_answer)."""
    return [float(normalize_answer(c) == normalize_answer(a)) for c, a in zip(completions, _answered(answers))]


def math_match(prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
    """1.0 where math-verify finds the completion's answer mathematically equal to the reference answer
    (`verify(parse(answer), parse(completion))`: "\\frac{1}{2}" and "0.5" are equal)."""
    # Here, not at the top: math-verify brings sympy (~0.4 s), paid only by runs that score with it.
    from math_verify import parse, verify

    return [float(verify(parse(a), parse(c))) for c, a in zip(completions, _answered(answers))]


def _answered(answers: list[str | None]) -> list[str]:
    missing = [i for i, a in enumerate(answers) if a is None]
    if missing:
        raise ValueError(f"{len(missing)} of {len(answers)} prompts have no answer (e.g. the one at position "
                         f"{missing[0]}): give every prompt record an 'answer', or use a reward function of your own")
    return answers


# grpo.reward's built-in names -> (function, the PyPI package it needs or None).
BUILTINS = {"exact_match": (exact_match, None), "math": (math_match, "math-verify")}
