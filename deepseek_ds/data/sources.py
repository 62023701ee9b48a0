"""Input discovery and document reading: text files/directories, JSON Lines, .json arrays, saved HF datasets.

Scanning is cheap (file sizes and line offsets, no decoding) and yields a `DocTable`: one row per
document in a fixed, sorted order, so that every process derives the same documents from the same inputs.
Reading turns a subset of rows back into strings inside the tokenizer workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .chat import ChatFormatError, Message, parse_line
from .errors import DataError
from .formats import AUTO
from .jsonarray import ACCEPTED, ARRAY, array_spans, json_layout

TEXT, JSONL, JSON, HF = "text", "jsonl", "json", "hf"
_HF_MARKERS = ("dataset_dict.json", "state.json")
# What a directory input contributes: prose and source code. Anything else (a stray .csv, a binary, a log) is
# skipped and listed, so a corpus is what the user meant; files named explicitly are always read.
DEFAULT_EXTENSIONS = (".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".jsonl", ".py", ".pyi", ".c", ".h",
                      ".cc", ".cpp", ".hpp", ".cu", ".java", ".js", ".ts", ".go", ".rs", ".rb", ".sh", ".sql")


@dataclass(frozen=True)
class Source:
    path: str
    # TEXT (whole file is one document), JSONL (one document per line), JSON (one per record of a file holding one
    # array: read as JSONL lines are, by byte span) or HF (one per row)
    kind: str
    split: str | None = None  # HF: the DatasetDict split asked for (--split); None: a Dataset, or "train"


@dataclass(frozen=True)
class DocTable:
    """Documents in corpus order. `offset` is a byte offset (JSONL, JSON), a row (HF) or 0 (text);
    `size` is the document's size in bytes (estimated for HF rows) and only sizes shards."""

    sources: tuple[Source, ...]
    source: np.ndarray  # int64 index into `sources`
    offset: np.ndarray  # int64
    size: np.ndarray  # int64
    skipped: tuple[str, ...] = ()  # files under directory inputs without a corpus extension
    read_splits: tuple[str, ...] = ()  # one line per DatasetDict input: which split was read, which it has

    def __len__(self) -> int:
        return len(self.source)

    def subset(self, rows: np.ndarray) -> DocTable:
        return DocTable(self.sources, self.source[rows], self.offset[rows], self.size[rows])

    def refs(self) -> list[list]:
        """JSON-able description of every document, for plan hashes."""
        # The split only when chosen, so the hashes of datasets prepared before --split existed stay the same.
        names = [s.path if s.split is None else f"{s.path}[{s.split}]" for s in self.sources]
        return [[names[s], self.sources[s].kind, int(o), int(n)] for s, o, n in zip(self.source, self.offset, self.size)]


def _is_hf_dataset(path: Path) -> bool:
    return any((path / m).is_file() for m in _HF_MARKERS)


def _files_under(root: Path, extensions: tuple[str, ...] | None) -> tuple[list[Path], list[Path]]:
    """(files to read, files skipped for their extension); `extensions` None takes every file."""
    # Hidden entries (.git, .DS_Store, editor swap files) are never corpus text.
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
    found.sort()
    if extensions is None:
        return found, []
    wanted = {e.lower() for e in extensions}
    return [f for f in found if f.suffix.lower() in wanted], [f for f in found if f.suffix.lower() not in wanted]


def _file_source(path: Path) -> Source:
    """A file's source: .jsonl is JSON Lines; .json one array of records, or JSON Lines under that name; else text."""
    kind = {".jsonl": JSONL, ".json": JSONL}.get(path.suffix.lower(), TEXT)
    if path.suffix.lower() == ".json" and json_layout(str(path)) == ARRAY:
        kind = JSON
    return Source(str(path.resolve()), kind)


def _expand(inputs: list[str], extensions: tuple[str, ...] | None,
            split: str | None = None) -> tuple[list[Source], list[str]]:
    sources, skipped = [], []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir() and _is_hf_dataset(path):
            sources.append(Source(str(path.resolve()), HF, split))
        elif path.is_dir():
            files, left = _files_under(path, extensions)
            sources += [_file_source(f) for f in files]
            skipped += [str(f) for f in left]
        elif path.is_file():
            sources.append(_file_source(path))
        else:
            raise DataError(f"input {raw!r} does not exist: pass existing text files, directories, "
                            f".jsonl files, .json files holding one array of records or a directory saved with "
                            "datasets' save_to_disk")
    return sources, skipped


def _jsonl_lines(path: str) -> tuple[list[int], list[int]]:
    offsets, sizes, pos = [], [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():  # blank lines are separators, not documents
                offsets.append(pos)
                sizes.append(len(line))
            pos += len(line)
    return offsets, sizes


def _hf_open(path: str, split: str | None):
    """(the rows to read: a Dataset, or split `split` of a DatasetDict ("train" when None), a line saying which
    split of a DatasetDict that is, or None for a Dataset)."""
    from datasets import Dataset, load_from_disk  # optional (the `data` extra) and slow to import: only for HF inputs

    loaded = load_from_disk(path)
    if isinstance(loaded, Dataset):
        if split is not None:
            raise DataError(f"{path} is one Dataset, not a DatasetDict: --split {split} does not apply to it: leave "
                            "--split out, or pass that input in a separate prepare")
        return loaded, None
    name, names = split or "train", sorted(loaded)
    if name not in loaded:
        raise DataError(f"{path} has no split {name!r} (splits: {', '.join(names)}): pass "
                        + " or ".join(f"--split {n}" for n in names))
    return loaded[name], f"read split {name!r} of {path} (splits: {', '.join(names)}; choose with --split)"


def _hf_split(src: Source):
    return _hf_open(src.path, src.split)[0]


def _hf_rows(src: Source, field: str) -> tuple[list[int], list[int], str | None]:
    ds, note = _hf_open(src.path, src.split)
    if field not in ds.column_names:
        raise DataError(f"{src.path} has no column {field!r} (columns: {ds.column_names}): "
                        f"pass the text column with --jsonl-field / jsonl_field")
    row_bytes = max(1, ds.data.nbytes // max(1, len(ds)))
    return list(range(len(ds))), [row_bytes] * len(ds), note


def scan_inputs(inputs: list[str], field: str, extensions: tuple[str, ...] | None = DEFAULT_EXTENSIONS,
                split: str | None = None) -> DocTable:
    """Every document of `inputs` in deterministic order; DataError when there is nothing to read. Directories
    contribute their files with one of `extensions` (None: every file); the others are listed in `skipped`. A saved
    DatasetDict contributes its split `split` ("train" when None)."""
    sources, skipped = _expand(inputs, extensions, split)
    source, offset, size, notes = [], [], [], []
    for i, src in enumerate(sources):
        if src.kind == TEXT:
            offs, sizes = [0], [os.path.getsize(src.path)]
        elif src.kind == JSONL:
            offs, sizes = _jsonl_lines(src.path)
        elif src.kind == JSON:
            offs, sizes = array_spans(src.path)
        else:
            offs, sizes, note = _hf_rows(src, field)
            notes += [note] if note else []
        source += [i] * len(offs)
        offset += offs
        size += sizes
    table = DocTable(tuple(sources), np.array(source, np.int64), np.array(offset, np.int64), np.array(size, np.int64),
                     tuple(skipped), tuple(notes))
    if len(table) == 0 or int(table.size.sum()) == 0:
        also = f" ({len(skipped)} files skipped for their extension, e.g. {skipped[0]})" if skipped else ""
        raise DataError(f"no text found in inputs {inputs}{also}: pass non-empty UTF-8 text files, directories of "
                        f"them, .jsonl files, .json files holding one array of records or saved HF datasets")
    return table


def scan_chat(inputs: list[str], skip_bad: bool, fmt: str = AUTO,
              split: str | None = None) -> tuple[DocTable, list[str]]:
    """One row per conversation of the inputs (.jsonl files, .json files holding one array of records, directories of
    them, saved HF datasets: a Dataset, or split `split` of a DatasetDict), records of format `fmt`
    (formats.LINE_FORMATS), each parsed here so a bad one is reported with its file:line (file[index] in an array, or
    row) before any tokenizing; (table, one error line per bad conversation skipped)."""
    sources, _ = _expand(inputs, (".jsonl", ".json"), split)
    other = next((s.path for s in sources if s.kind == TEXT), None)
    if other is not None:
        raise DataError(f"{other} is not a record file: data prepare --format {fmt if fmt != AUTO else 'chat'} reads "
                        f"{ACCEPTED}, or a saved HF dataset (rename a JSON Lines file to .jsonl)")
    source, offset, size, bad, notes = [], [], [], [], []
    for i, src in enumerate(sources):
        for where, text, at, length in _conversations(src, notes):
            try:
                parse_line(text, where, fmt)
            except DataError as e:
                if not skip_bad:
                    raise ChatFormatError(str(e), hint="fix the line, or pass --skip-bad to skip bad lines") from e
                bad.append(str(e))
                continue
            source.append(i)
            offset.append(at)
            size.append(length)
    if not source:
        raise DataError(f"no conversation found in inputs {inputs}" + (f" ({len(bad)} bad lines skipped)" if bad else "")
                        + f": pass {ACCEPTED}, or a saved HF dataset")
    return DocTable(tuple(sources), np.array(source, np.int64), np.array(offset, np.int64),
                    np.array(size, np.int64), read_splits=tuple(notes)), bad


def _conversations(src: Source, notes: list[str]) -> Iterator[tuple[str, str, int, int]]:
    """(where, JSON text, offset, size) of each conversation of a source: a .jsonl file's non-blank lines or a .json
    array's records (offset: its byte), a saved HF dataset's rows (offset: the row). Which split of a DatasetDict is
    read goes to `notes`."""
    if src.kind == HF:
        ds, note = _hf_open(src.path, src.split)
        notes += [note] if note else []
        for row, record in enumerate(ds):
            text = _hf_conversation(record)
            yield f"{src.path} row {row}", text, row, len(text.encode())
        return
    if src.kind == JSON:
        data = Path(src.path).read_bytes()
        for index, (at, length) in enumerate(zip(*array_spans(src.path))):
            where = f"{src.path}[{index}]"  # jq's spelling of the array's record (from 0)
            yield where, _decode(data[at:at + length], where), at, length
        return
    with open(src.path, "rb") as f:
        pos = 0
        for number, raw in enumerate(f, 1):
            if raw.strip():
                where = f"{src.path}:{number}"
                yield where, _decode(raw, where), pos, len(raw)
            pos += len(raw)


def _hf_conversation(record: dict) -> str:
    """A dataset row as its JSON line. A dataset's columns are the union of its rows' keys: a prompt/response row of a
    dataset that also has `messages` rows holds messages=None, which its own line would not have."""
    return json.dumps({k: v for k, v in record.items() if v is not None}, ensure_ascii=False)


def read_conversation_rows(table: DocTable, fmt: str = AUTO) -> list[tuple[Message, ...]]:
    """The conversations of the rows of a table made by scan_chat (with the same `fmt`), in order."""
    out = []
    for s in np.unique(table.source):  # rows of one source are contiguous (scan order): one open per file
        src = table.sources[int(s)]
        rows = np.flatnonzero(table.source == s)
        if src.kind == HF:
            ds = _hf_split(src)
            out += [parse_line(_hf_conversation(ds[int(o)]), f"{src.path} row {int(o)}", fmt)
                    for o in table.offset[rows]]
            continue
        with open(src.path, "rb") as f:
            for o, n in zip(table.offset[rows], table.size[rows]):
                f.seek(int(o))
                where = f"{src.path} ({_unit(src)} starting at byte {int(o)})"
                out.append(parse_line(_decode(f.read(int(n)), where), where, fmt))
    return out


def split_text_tail(table: DocTable, fraction: float) -> DocTable | None:
    """A corpus of one text document, cut in two at a line boundary: the last `fraction` of its bytes (at least one
    line) becomes a second document, so a single file still gets a validation split. None when it cannot be cut
    (a JSON record, or a single line)."""
    src = table.sources[int(table.source[0])]
    if src.kind != TEXT or len(table) != 1:
        return None
    data = Path(src.path).read_bytes()
    cut = data.rfind(b"\n", 0, max(1, round(len(data) * (1 - fraction)))) + 1
    if cut <= 0 or not data[:cut].strip() or not data[cut:].strip():
        return None
    return DocTable(table.sources, np.array([table.source[0]] * 2, np.int64), np.array([0, cut], np.int64),
                    np.array([cut, len(data) - cut], np.int64), table.skipped, table.read_splits)


def _decode(data: bytes, where: str) -> str:
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) opens the file and is no text.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not valid UTF-8 (bad byte at offset {e.start}): convert it, e.g. "
                        f"`iconv -f latin1 -t utf-8`, or remove it from the inputs") from e


def _unit(src: Source) -> str:
    return "record" if src.kind == JSON else "line"


def _jsonl_doc(f, src: Source, offset: int, size: int, field: str) -> str:
    path = src.path
    f.seek(offset)
    line = f.read(size)
    where = f"{path} ({_unit(src)} starting at byte {offset})"
    try:
        record = json.loads(_decode(line, where))
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON ({e.msg}): fix or remove that {_unit(src)}") from e
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} has no string field {field!r} (found {keys}): "
                        f"choose the text field with --jsonl-field / jsonl_field")
    return value


def _hf_docs(src: Source, rows: list[int], field: str) -> list[str]:
    path = src.path
    values = _hf_split(src)[rows][field]
    bad = next((v for v in values if not isinstance(v, str)), None)
    if bad is not None:
        raise DataError(f"{path}: column {field!r} holds {type(bad).__name__}, not text: "
                        f"choose a string column with --jsonl-field / jsonl_field")
    return values


def read_docs(table: DocTable, field: str) -> list[str]:
    """The text of every row of `table`, in order."""
    texts: list[str] = []
    i = 0
    while i < len(table):
        # Consecutive rows of one source are read together: one open / one HF load per run.
        s = int(table.source[i])
        j = i
        while j < len(table) and table.source[j] == s:
            j += 1
        src = table.sources[s]
        if src.kind == TEXT:
            # A row is a byte range: the whole file, or one side of split_text_tail's cut at a newline.
            data = Path(src.path).read_bytes()
            texts += [_decode(data[o:o + n], src.path) for o, n in zip(table.offset[i:j], table.size[i:j])]
        elif src.kind in (JSONL, JSON):
            with open(src.path, "rb") as f:
                texts += [_jsonl_doc(f, src, int(o), int(n), field)
                          for o, n in zip(table.offset[i:j], table.size[i:j])]
        else:
            texts += _hf_docs(src, [int(r) for r in table.offset[i:j]], field)
        i = j
    return texts
