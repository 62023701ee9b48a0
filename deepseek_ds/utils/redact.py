"""Credentials kept out of the files a run writes (resolved_config.yaml, checkpoint.json): a monitor's API key in
the DeepSpeed JSON (wandb, comet) must not be copied next to every checkpoint."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
# The last word of a key name, not a substring or any word: `api_key`, `HF_TOKEN`, `apiKey`, `AWS_SECRET_ACCESS_KEY`
# are credentials; `tokenizer_hash`, `max_tokens`, `reduce_bucket_size`, and model fields such as `bos_token_id`
# or `num_key_value_heads` (which a resume compares) are not.
_SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"}
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def is_secret_key(name: str) -> bool:
    """Whether a key name looks like it holds a credential (case-insensitive, by its last word)."""
    words = _WORD.findall(str(name))
    return bool(words) and words[-1].lower() in _SECRET_WORDS


def redact(value: Any) -> Any:
    """A copy of `value` (nested dicts and lists) with the value of every credential-like key replaced by
    REDACTED; empty values (null, "") stay as they are, so the record still shows that none was set."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_key(k) and not isinstance(v, (dict, list)) and v not in (None, "")
                else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value
