"""`.json` record files: one JSON array of records (what LLaMA-Factory's Alpaca and ShareGPT files are), or JSON
Lines under a .json name. An array's records are located by their byte spans in the file, so they are read (seek,
read, parse) exactly as JSON Lines lines are, and a record tokenizes to the same ids whichever file holds it.
"""

from __future__ import annotations

import json
import re

from .errors import DataError

# What a record file may be, for every message that refuses one.
ACCEPTED = "a JSON Lines file (one record a line) or a .json file holding one array of records"
ARRAY, LINES = "array", "lines"
_BOM = b"\xef\xbb\xbf"
_WS = re.compile(r"[ \t\n\r]*")
_SNIFF = 4096  # bytes read to tell an array from lines; whitespace before the first value rarely runs longer


def _text(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 (bad byte at offset {e.start}): convert it, e.g. "
                        "`iconv -f latin1 -t utf-8`, or remove it from the inputs") from e


def json_layout(path: str) -> str:
    """ARRAY when the file's first value opens an array, LINES when it holds several values (JSON Lines) or none;
    DataError for a file that is one value other than an array (an object of splits, a single record, ...)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF).removeprefix(_BOM).lstrip()
        if head.startswith(b"["):
            return ARRAY
        f.seek(0)
        data = f.read().removeprefix(_BOM)
    try:
        value = json.loads(_text(data, path))
    except json.JSONDecodeError:
        return LINES  # several values (or a bad line, which the line's own check reports with its number)
    what, fix = f"a JSON {type(value).__name__}", ""
    if isinstance(value, dict):
        what = f"one object (keys: {', '.join(sorted(value)[:6]) or 'none'})"
        listed = next((k for k in sorted(value) if isinstance(value[k], list)), None)
        # Either a record on its own or records under a key (a split's name): the fix for each, no guess between.
        fix = "; a single record goes in a list: [{...}]" + (
            f"; if its {listed!r} holds the records, `jq -c '.{listed}[]' {path}` prints them as JSON Lines"
            if listed else "")
    raise DataError(f"{path} holds {what}, not a list of records: pass {ACCEPTED}{fix}")


def array_spans(path: str) -> tuple[list[int], list[int]]:
    """(byte offset, byte size) of every record of a file holding one JSON array, in order; DataError naming the
    line and column where the file stops being one."""
    with open(path, "rb") as f:
        data = f.read()
    base = len(_BOM) if data.startswith(_BOM) else 0
    text = _text(data[base:], path)
    ascii_only = data.isascii()
    decoder = json.JSONDecoder()
    offsets, sizes = [], []
    done_chars, done_bytes = 0, base  # byte position of character `done_chars`, advanced as records are found

    def byte_at(char: int) -> int:
        nonlocal done_chars, done_bytes
        if ascii_only:
            return base + char
        done_bytes += len(text[done_chars:char].encode())
        done_chars = char
        return done_bytes

    def fail(msg: str, at: int) -> DataError:
        line = text.count("\n", 0, at) + 1
        column = at - text.rfind("\n", 0, at)
        return DataError(f"{path} is not one JSON array of records ({msg} at line {line} column {column}): fix it, "
                         f"or pass {ACCEPTED}")

    at = _WS.match(text).end() + 1  # past "["
    at = _WS.match(text, at).end()
    if text.startswith("]", at):
        at += 1
    else:
        while True:
            try:
                _, end = decoder.raw_decode(text, at)
            except json.JSONDecodeError as e:
                raise fail(e.msg, e.pos) from e
            start = byte_at(at)
            offsets.append(start)
            sizes.append(byte_at(end) - start)
            at = _WS.match(text, end).end()
            if text.startswith("]", at):
                at += 1
                break
            if not text.startswith(",", at):
                raise fail("expected ',' or ']' after a record", at)
            at = _WS.match(text, at + 1).end()
    if _WS.match(text, at).end() != len(text):
        raise fail("extra data after the array", _WS.match(text, at).end())
    return offsets, sizes
