"""Conversations: the two JSON Lines formats, and their token ids with a per-token trained mask.

A line is `{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`,
`{"prompt": ..., "response": ...}` (one user and one assistant turn), or an Alpaca or ShareGPT record (formats.py).
It must hold an assistant turn with content and end with one. A conversation renders through the
tokenizer's `chat_template` when it has one, otherwise in DeepSeek-V3's chat format:

    BOS system-content (<｜User｜> user-content | <｜Assistant｜> assistant-content EOS)*

where the markers, BOS and EOS are inserted as special-token ids and every content is tokenized on its own, so
the boundary between trained tokens (assistant contents and their closing EOS) and untrained ones is exact.
`encode` is what training data is made of; `encode_prompt` (ending in `<｜Assistant｜>`) is what a model generates
from; `task_items` reads a held-out task: each conversation's last assistant turn is its reference, and the model is
shown the turns before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import DataError
from .formats import AUTO, as_messages
from .layout import PREFERENCE_FORMAT as PREFERENCE
from .layout import PROMPTS_FORMAT as PROMPTS
from .pairs import pair_messages
from .prompts import prompt_record

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
ROLES = (SYSTEM, USER, ASSISTANT)
TRAIN_ON = ("all", "last")  # which assistant turns carry the loss
USER_MARKER, ASSISTANT_MARKER = "<｜User｜>", "<｜Assistant｜>"
# DeepSeek-V3's template joins several system messages this way.
_SYSTEM_JOIN = "\n\n"


class ChatFormatError(DataError):
    """A conversation line that is not in either format, or a tokenizer that cannot render conversations."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class TaskItem:
    prompt_ids: list[int]  # what the model answers from (encode_prompt)
    reference: str         # the conversation's last assistant turn


@dataclass(frozen=True)
class Encoded:
    """A rendered conversation: its token ids and, per token, whether the loss is computed on it."""

    ids: list[int]
    trained: list[bool]


# ----------------------------------------------------------------------------------------------- parsing
def _messages_of(record, fmt: str):
    """The conversation of a record; for PREFERENCE records the pair (chosen, rejected) of conversations, for PROMPTS
    records (the prompt's turns, its answer or None)."""
    if fmt == PREFERENCE:
        return tuple(_checked(raw) for raw in pair_messages(record))
    if fmt == PROMPTS:
        raw, answer = prompt_record(record)
        return _checked_prompt(raw), answer
    return _checked(as_messages(record, fmt))


def _checked_prompt(raw) -> tuple[Message, ...]:
    """The turns of a prompt: valid turns whose last (after system turns) is a user turn with text, which the model
    answers."""
    messages = _turns(raw)
    asked = [i for i, m in enumerate(messages) if m.role != SYSTEM]
    if not asked or all(messages[i].role != USER for i in asked):
        raise ValueError("no user turn: a prompt needs one (the question the model answers)")
    if messages[asked[-1]].role != USER:
        raise ValueError(f"ends with an assistant turn (message {asked[-1]}): the last turn must be the user's, which "
                         "the model answers; drop that turn")
    if not messages[asked[-1]].content.strip():
        raise ValueError(f"empty prompt: the last user turn (message {asked[-1]}) has no text")
    return messages


def _checked(raw) -> tuple[Message, ...]:
    messages = _turns(raw)
    if not any(m.role == ASSISTANT for m in messages):
        raise ValueError("no assistant turn")
    last = max(i for i, m in enumerate(messages) if m.role != SYSTEM)
    if messages[last].role == USER:
        # Trained on, it would teach nothing; as a task item, its reference would answer an earlier question.
        raise ValueError(f"ends with a user turn (message {last}) that no assistant turn answers: add the answer or "
                         "drop that turn")
    return messages


def _turns(raw) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise ValueError("empty conversation: 'messages' must be a non-empty list")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ValueError(f"message {i}: unknown role {role!r} (use {', '.join(ROLES)})")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: 'content' must be a string")
        if m["role"] == ASSISTANT and not m["content"].strip():
            raise ValueError(f"message {i}: empty assistant content: nothing to train on or score")
        messages.append(Message(m["role"], m["content"]))
    return tuple(messages)


def parse_line(line: str, where: str, fmt: str = AUTO) -> tuple[Message, ...]:
    """The messages of one JSON Lines line in format `fmt` (formats.LINE_FORMATS; AUTO: each line's own; PREFERENCE:
    the pair (chosen, rejected) of conversations, pairs.py; PROMPTS: (turns, answer), prompts.py); ChatFormatError naming `where` (file:line) and what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ChatFormatError(f"{where}: not JSON ({e.msg} at column {e.colno})") from e
    try:
        return _messages_of(record, fmt)
    except ValueError as e:
        raise ChatFormatError(f"{where}: {e}") from e


def read_conversations(path: str, skip_bad: bool = False) -> tuple[list[tuple[Message, ...]], list[str]]:
    """(the conversations of a JSON Lines file in order, one error line per bad line skipped). Without skip_bad
    the first bad line is raised (the fix: correct it, or pass --skip-bad). Blank lines are not items."""
    conversations, bad = [], []
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM (Windows editors write one) is no character
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    conversations.append(parse_line(line, f"{path}:{number}"))
                except ChatFormatError as e:
                    if not skip_bad:
                        raise ChatFormatError(str(e), hint="fix the line, or pass --skip-bad to skip bad lines") from e
                    bad.append(str(e))
    except OSError as e:
        raise ChatFormatError(f"cannot read {path}: {e.strerror}") from e
    if not conversations:
        raise ChatFormatError(f"{path} holds no conversation" + (f" ({len(bad)} bad lines skipped)" if bad else ""))
    return conversations, bad


def split_reference(messages: tuple[Message, ...]) -> tuple[tuple[Message, ...], str]:
    """(what the model is shown: everything before the last assistant turn, that turn's content: the reference)."""
    last = max(i for i, m in enumerate(messages) if m.role == ASSISTANT)
    return messages[:last], messages[last].content


# ----------------------------------------------------------------------------------------------- rendering
# A rendering is a list of segments (token ids, assistant-turn number or None), concatenated in order; only the
# segments of assistant turns (their content and closing EOS) can be trained.
Segments = list[tuple[list[int], "int | None"]]


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids if text else []


def _deepseek_markers(tokenizer) -> tuple[dict[str, int], list[str]]:
    """(the two chat markers' ids, what of DeepSeek's chat tokens the tokenizer lacks: markers, BOS, EOS)."""
    # One id lookup per marker: get_vocab() builds the whole vocabulary dict (~0.3 s for DeepSeek's 129k tokens) and
    # this runs once per conversation. An absent token converts to the unknown token's id, or None without one.
    markers = dict(zip((USER_MARKER, ASSISTANT_MARKER), tokenizer.convert_tokens_to_ids([USER_MARKER, ASSISTANT_MARKER])))
    missing = [t for t, i in markers.items() if i is None or (i == tokenizer.unk_token_id and t != tokenizer.unk_token)]
    missing += [name for name, i in (("BOS", tokenizer.bos_token_id), ("EOS", tokenizer.eos_token_id)) if i is None]
    return markers, missing


def has_deepseek_chat_tokens(tokenizer) -> bool:
    """Whether the tokenizer can render DeepSeek-V3's chat format (its markers, BOS and EOS)."""
    return not _deepseek_markers(tokenizer)[1]


def _deepseek_ids(tokenizer) -> tuple[int, int, int, int]:
    """(BOS, EOS, <｜User｜>, <｜Assistant｜>) ids; ChatFormatError when the tokenizer lacks any of them."""
    markers, missing = _deepseek_markers(tokenizer)
    if missing:
        where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise ChatFormatError(f"{where} has no chat_template and lacks DeepSeek's chat tokens ({', '.join(missing)})",
                              hint="add a chat_template to its tokenizer_config.json, or use a DeepSeek tokenizer")
    return tokenizer.bos_token_id, tokenizer.eos_token_id, markers[USER_MARKER], markers[ASSISTANT_MARKER]


def _deepseek_segments(tokenizer, messages: tuple[Message, ...], generation_prompt: bool) -> Segments:
    bos, eos, user, assistant = _deepseek_ids(tokenizer)
    system = _SYSTEM_JOIN.join(m.content for m in messages if m.role == SYSTEM)
    segments: Segments = [([bos] + _text_ids(tokenizer, system), None)]
    turn = 0
    for m in messages:
        if m.role == USER:
            segments.append(([user] + _text_ids(tokenizer, m.content), None))
        elif m.role == ASSISTANT:
            segments.append(([assistant], None))
            segments.append((_text_ids(tokenizer, m.content) + [eos], turn))
            turn += 1
    if generation_prompt:
        segments.append(([assistant], None))
    return segments


def _template_segments(tokenizer, messages: tuple[Message, ...], generation_prompt: bool) -> Segments:
    """The chat_template's text cut where each assistant turn starts (the render of the turns before it, with the
    generation prompt) and ends (the render up to and including it); each piece tokenized on its own."""
    dicts = [{"role": m.role, "content": m.content} for m in messages]

    def render(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(dicts[:upto], tokenize=False, add_generation_prompt=prompt)

    full = render(len(dicts), generation_prompt)
    cuts: list[tuple[int, int | None]] = []  # (text position, turn number of the piece starting there)
    turn = 0
    for i, m in enumerate(messages):
        if m.role != ASSISTANT:
            continue
        start, end = render(i, True), render(i + 1, False)
        after = cuts[-1][0] if cuts else 0
        if not (full.startswith(start) and full.startswith(end) and after <= len(start) <= len(end)):
            raise ChatFormatError(f"the chat_template of {tokenizer.name_or_path} does not render a conversation's "
                                  f"turns as prefixes of the whole, so the trained tokens cannot be told apart",
                                  hint="use a template that only appends per turn, or remove it for DeepSeek's format")
        cuts += [(len(start), turn), (len(end), None)]
        turn += 1
    bounds = [(0, None)] + cuts + [(len(full), None)]
    return [(_text_ids(tokenizer, full[a:b]), t) for (a, t), (b, _) in zip(bounds, bounds[1:]) if b > a]


def _segments(tokenizer, messages: tuple[Message, ...], generation_prompt: bool) -> Segments:
    if getattr(tokenizer, "chat_template", None):
        return _template_segments(tokenizer, messages, generation_prompt)
    return _deepseek_segments(tokenizer, messages, generation_prompt)


def encode(tokenizer, messages: tuple[Message, ...], train_on: str = "all") -> Encoded:
    """Token ids of a whole conversation, trained on every assistant turn (train_on "all") or the final one
    ("last"): its content and closing EOS (with a chat_template, whatever the template renders for that turn)."""
    if train_on not in TRAIN_ON:
        raise ChatFormatError(f"train_on {train_on!r}: use one of {', '.join(TRAIN_ON)}")
    segments = _segments(tokenizer, messages, generation_prompt=False)
    last = sum(m.role == ASSISTANT for m in messages) - 1
    ids, trained = [], []
    for seg, turn in segments:
        ids += seg
        trained += [turn is not None and (train_on == "all" or turn == last)] * len(seg)
    return Encoded(ids, trained)


def encode_prompt(tokenizer, messages: tuple[Message, ...]) -> list[int]:
    """Token ids a model continues to answer `messages`: the conversation and the opening of an assistant turn."""
    return [i for seg, _ in _segments(tokenizer, messages, generation_prompt=True) for i in seg]


def task_items(path: str, tokenizer, items: int = 0, skip_bad: bool = False) -> tuple[list[TaskItem], list[str]]:
    """(the first `items` items of a task file, all with 0; the errors of the bad lines skipped)."""
    conversations, bad = read_conversations(path, skip_bad)
    out = []
    for messages in conversations[:items or None]:
        shown, reference = split_reference(messages)
        out.append(TaskItem(encode_prompt(tokenizer, shown), reference))
    return out, bad


def fitting_items(items: list[TaskItem], max_positions: int, task: str, skip_bad: bool) -> tuple[list[TaskItem], int]:
    """(the items whose prompt leaves the model room to answer, how many do not); without skip_bad a prompt that
    does not fit is refused: the model would answer nothing and the item would count as a miss (`eval --task`
    and, skipping, `eval.task` during training)."""
    long = [number for number, item in enumerate(items, 1) if len(item.prompt_ids) >= max_positions]
    if long and not skip_bad:
        first = items[long[0] - 1]
        raise ChatFormatError(f"{task}: {len(long)} of {len(items)} items have a prompt of at least the model's "
                              f"max_position_embeddings ({max_positions}) tokens, e.g. item {long[0]} "
                              f"({len(first.prompt_ids)} tokens), which leaves no room for an answer",
                              hint="shorten those prompts, or pass --skip-bad to skip (and count) them")
    if len(long) == len(items):
        raise ChatFormatError(f"{task}: no item has a prompt shorter than the model's max_position_embeddings "
                              f"({max_positions} tokens)")
    skipped = set(long)
    return [item for number, item in enumerate(items, 1) if number not in skipped], len(long)
