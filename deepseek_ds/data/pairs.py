"""Preference records (`data prepare --format preference`) as two conversations that share a prompt, in the raw
`{"role", "content"}` form chat.py checks and renders.

The forms TRL's DPOTrainer reads:
- `{"prompt": str, "chosen": str, "rejected": str}`: one user turn and one assistant answer each;
- `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}` (explicit prompt, conversational);
- `{"chosen": [messages], "rejected": [messages]}` (implicit prompt): the longest shared prefix is the prompt.

After the prompt each side must be exactly one assistant message: the response the loss (and the reward) is on.
Errors are ValueErrors whose text chat.py prefixes with the line's file:line.
"""

from __future__ import annotations

# Fewer validation pairs than this and the eval reward accuracy moves in steps of more than 12.5%: noise, not a signal.
MIN_VALID_PAIRS = 8


def small_valid_warning(pairs: int) -> str | None:
    """The warning a preference dataset's validation split of `pairs` pairs gets (prepare's summary, a DPO run's
    start), or None when it is empty (said elsewhere) or large enough."""
    if not 0 < pairs < MIN_VALID_PAIRS:
        return None
    return (f"the validation split holds only {pairs} preference pair{'s' * (pairs != 1)} (fewer than "
            f"{MIN_VALID_PAIRS}): its reward accuracy moves in steps of {100 / pairs:.0f}% and means little; prepare "
            "the data with a larger --valid-fraction")


def _as_messages(value, key: str, role: str | None = None) -> list:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return [{"role": m.get("role"), "content": m.get("content")} for m in value]
    raise ValueError(f"{key!r} must be a string or a list of {{\"role\", \"content\"}} messages")


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return n


def pair_messages(record) -> tuple[list, list]:
    """(prompt + chosen, prompt + rejected) as raw message lists of one preference record."""
    if not isinstance(record, dict):
        raise ValueError(f"a {type(record).__name__}, not a preference object {{\"prompt\", \"chosen\", \"rejected\"}}")
    missing = [k for k in ("chosen", "rejected") if record.get(k) is None]
    if missing:
        raise ValueError(f"a preference record needs 'chosen' and 'rejected' (missing: {', '.join(missing)}; keys: "
                         f"{', '.join(sorted(record)) or 'none'})")
    prompt = record.get("prompt")
    chosen, rejected = (_as_messages(record[k], k, "assistant") for k in ("chosen", "rejected"))
    if prompt is None:
        if isinstance(record["chosen"], str) or isinstance(record["rejected"], str):
            raise ValueError("'chosen' and 'rejected' strings need a 'prompt' (or give message lists that share "
                             "their prompt turns)")
        n = _common_prefix(chosen, rejected)
        prompt_msgs, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        prompt_msgs = _as_messages(prompt, "prompt", "user")
    if not prompt_msgs:
        raise ValueError("no prompt: 'prompt' is empty, or 'chosen' and 'rejected' share no turn before their answers")
    for key, side in (("chosen", chosen), ("rejected", rejected)):
        if len(side) != 1 or side[0]["role"] != "assistant":
            raise ValueError(f"{key!r} must be one assistant message after the prompt, got "
                             f"{[m['role'] for m in side]}")
    return prompt_msgs + chosen, prompt_msgs + rejected
