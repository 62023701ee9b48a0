"""The conversation record formats instruction sets ship in, each turned into the one form chat.py reads: a list of
`{"role": "system"|"user"|"assistant", "content": ...}` messages.

- messages: `{"messages": [{"role", "content"}, ...]}`, or `{"prompt", "response"}` (one user and one assistant turn)
- alpaca: `{"instruction", "input", "output"}` with an optional `system` and `history` ([[user, assistant], ...])
- sharegpt: `{"conversations": [{"from", "value"}, ...]}` (roles human/gpt/system, or user/assistant; `role`/
  `content` keys too) with an optional `system`

Both are read as LLaMA-Factory reads them (its `AlpacaDatasetConverter` / `SharegptDatasetConverter`), so a dataset
made for it trains on the same conversations here. Tool use (a `tools` field, function_call / observation turns)
is refused: DeepSeek's chat format as rendered here has no tool turns. Errors are ValueErrors whose text chat.py
prefixes with the line's file:line.
"""

from __future__ import annotations

from .layout import FORMATS

AUTO, MESSAGES, ALPACA, SHAREGPT = "auto", "messages", "alpaca", "sharegpt"
LINE_FORMATS = (AUTO, MESSAGES, ALPACA, SHAREGPT)
# `data prepare --format`: text, chat (each record's format told from its keys), or a chat dataset of one format.
INPUT_FORMATS = FORMATS + (ALPACA, SHAREGPT)
# The keys that say which format a record is in (auto-detection, one line at a time).
_KEYS = {MESSAGES: ("messages", "prompt", "response"), ALPACA: ("instruction", "output"),
         SHAREGPT: ("conversations",)}
_NAMES = {MESSAGES: "a messages", ALPACA: "an Alpaca", SHAREGPT: "a ShareGPT"}
_NEEDS = {MESSAGES: "'messages' or 'prompt' and 'response'", ALPACA: "'instruction' and 'output'",
          SHAREGPT: "'conversations'"}
# ShareGPT's role names (LLaMA-Factory's default tags, and the OpenAI spellings some sets use) -> ours.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_TOOL_ROLES = ("function_call", "observation", "function", "tool", "tool_call", "tool_response", "ipython")


def detect(record: dict) -> str:
    """The format of one record from its keys; ValueError when none or several match."""
    found = [fmt for fmt, keys in _KEYS.items() if any(k in record for k in keys)]
    if len(found) > 1:
        raise ValueError(f"keys of more than one format ({', '.join(found)}): pass "
                         + " or ".join(f"--format {f}" for f in found if f != MESSAGES))
    if not found:
        raise ValueError("neither 'messages' nor 'prompt'/'response' (the messages format), nor 'instruction'/'output' "
                         f"(Alpaca), nor 'conversations' (ShareGPT) (keys: {', '.join(sorted(record)) or 'none'})")
    return found[0]


def as_messages(record, fmt: str = AUTO) -> list:
    """The record's conversation as a raw `messages` list (chat.py checks roles and contents); `fmt` AUTO detects
    the format from the record's keys, any other LINE_FORMATS value requires that format."""
    if not isinstance(record, dict):
        raise ValueError(f"a {type(record).__name__}, not an object of a conversation format")
    if fmt == AUTO:
        fmt = detect(record)
    elif not any(k in record for k in _KEYS[fmt]):
        raise ValueError(f"not {_NAMES[fmt]} record: it needs {_NEEDS[fmt]} "
                         f"(keys: {', '.join(sorted(record)) or 'none'}); pass --format chat to detect each line's")
    if fmt == ALPACA:
        return _alpaca(record)
    if fmt == SHAREGPT:
        return _sharegpt(record)
    if "messages" in record:
        return record["messages"]
    if not (isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str)):
        raise ValueError("'prompt' and 'response' must both be strings")
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]


def _system(record: dict) -> list[dict]:
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string")
    return [{"role": "system", "content": system}] if system else []


def _alpaca(record: dict) -> list[dict]:
    fields = {k: record.get(k) or "" for k in ("instruction", "input", "output")}
    bad = [k for k, v in fields.items() if not isinstance(v, str)]
    if bad:
        raise ValueError(f"Alpaca field {bad[0]!r} must be a string")
    history = record.get("history") or []
    if not (isinstance(history, list) and all(isinstance(pair, (list, tuple)) and len(pair) == 2
                                              and all(isinstance(x, str) for x in pair) for pair in history)):
        raise ValueError("Alpaca 'history' must be a list of [user, assistant] pairs of strings")
    messages = _system(record)
    for user, assistant in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    # LLaMA-Factory's rule: the user turn is the instruction and the input joined by a newline, each left out when
    # empty (an input alone is the whole turn).
    user = "\n".join(x for x in (fields["instruction"], fields["input"]) if x)
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": fields["output"]}]


def _sharegpt(record: dict) -> list[dict]:
    if record.get("tools"):
        raise ValueError("'tools' (function calling) is not supported: remove the line, or its tools and tool turns")
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise ValueError("ShareGPT 'conversations' must be a list of {\"from\", \"value\"} turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {i}: a {type(turn).__name__}, not a {{\"from\", \"value\"}} object")
        # A column of a saved HF dataset holds None where a turn lacks a key: None is absent.
        role = turn.get("from") or turn.get("role")
        value = turn.get("value") if turn.get("value") is not None else turn.get("content")
        if role in _TOOL_ROLES:
            raise ValueError(f"turn {i}: {role!r} is a tool-use turn, which is not supported: remove tool turns "
                             "(or the line)")
        if role not in _SHAREGPT_ROLES:
            raise ValueError(f"turn {i}: unknown role {role!r} (use human, gpt or system; user and assistant too)")
        if not isinstance(value, str):
            raise ValueError(f"turn {i}: 'value' must be a string")
        messages.append({"role": _SHAREGPT_ROLES[role], "content": value})
    # As LLaMA-Factory: a first turn from "system" is the system prompt, and takes the place of the `system` field.
    if messages and messages[0]["role"] == "system":
        return messages
    return _system(record) + messages
