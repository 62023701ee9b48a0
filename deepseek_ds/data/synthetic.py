"""`deepseek-ds data synth-task`: a synthetic instruction task generated on the machine, to show that fine-tuning
works in minutes on a CPU. Each item asks for the letters of a random lowercase word reversed ("reverse kqzt" ->
"tzqk"; a short prompt, so most of each sequence is items, not instructions): the answer follows from the prompt alone, so a model can only score by learning the skill,
and the held-out words never occur in the training items (exact match there measures that, not memory).
`--kind copy` asks for the word unchanged ("copy kqzt" -> "kqzt"): a related task that teaches the chat format and
attending to the prompt's letters but not reversal, to pretrain the base that scripts/lora_demo.sh adapts. The words
drawn do not depend on the kind, so with the same --seed and --heldout a copy task's training words are the reversal
task's, and neither holds the reversal task's held-out words.
`--kind reverse-pairs` writes preference pairs for train.objective: dpo (scripts/dpo_demo.sh): {"prompt": "reverse
kqzt", "chosen": "tzqk", "rejected": a near miss}, the reversal with one letter wrong (two adjacent letters swapped,
or one letter replaced by another of the word's), the errors a fine-tuned model makes on this task (measured: a
wrong middle letter, often a neighbour's); chosen and rejected have the same length, so comparing their summed
log-probabilities is fair. The same words as the other kinds, and the same tokenizer, so an SFT model's ids fit.

The output directory holds train.jsonl and heldout.jsonl ({"prompt", "response"} lines; pairs for reverse-pairs)
and tokenizer/: a byte-level BPE with DeepSeek's chat markers and no merges (one token per letter, so reversing the
answer's letters reverses its tokens; a 260-token vocabulary keeps the embedding and the logits small on a CPU).
Everything is a function of --seed alone.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from .errors import DataError
from .tokenizer import CHAT_TOKENS, MIN_BPE_VOCAB, train_bpe

TRAIN_FILE, HELDOUT_FILE, TOKENIZER_SUBDIR = "train.jsonl", "heldout.jsonl", "tokenizer"
# Byte alphabet + EOS + the chat tokens, no merges: every letter stays its own token.
TASK_VOCAB_SIZE = MIN_BPE_VOCAB + len(CHAT_TOKENS)


def reversal_item(word: str) -> dict:
    return {"prompt": f"reverse {word}", "response": word[::-1]}


def copy_item(word: str) -> dict:
    return {"prompt": f"copy {word}", "response": word}


def near_miss(answer: str) -> str:
    """`answer` with one letter wrong, drawn from a Random seeded by the answer itself (the same pair whatever the
    order or number of words drawn): half the time two adjacent different letters swapped, else one letter replaced
    by another of the word's letters (the confusion of a model that lost its place), or by a random letter when the
    word has one letter only; never `answer` itself."""
    rng = random.Random(answer)
    swaps = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
    if swaps and rng.random() < 0.5:
        i = rng.choice(swaps)
        return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]
    i = rng.randrange(len(answer))
    others = sorted(set(answer) - {answer[i]}) or sorted(set(string.ascii_lowercase) - {answer[i]})
    return answer[:i] + rng.choice(others) + answer[i + 1:]


def reversal_pair(word: str) -> dict:
    chosen = word[::-1]
    return {"prompt": f"reverse {word}", "chosen": chosen, "rejected": near_miss(chosen)}


TASK_KINDS = {"reverse": reversal_item, "copy": copy_item, "reverse-pairs": reversal_pair}


def distinct_words(n: int, seed: int, min_len: int, max_len: int) -> list[str]:
    """n different random lowercase words of min_len..max_len letters, in drawing order."""
    if not 1 <= min_len <= max_len:
        raise DataError(f"word lengths {min_len}..{max_len}: need 1 <= --min-len <= --max-len")
    possible = sum(26 ** k for k in range(min_len, max_len + 1))
    if n > possible // 2:
        raise DataError(f"{n:,} distinct words of {min_len}..{max_len} letters asked for, out of {possible:,}: "
                        "pass a larger --max-len or a smaller --n")
    rng, seen, words = random.Random(seed), set(), []
    while len(words) < n:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def write_task(out: str, n_train: int, n_heldout: int, seed: int, min_len: int = 3, max_len: int = 5,
               kind: str = "reverse") -> Path:
    """Write train.jsonl (n_train items of `kind`), heldout.jsonl (n_heldout items, words disjoint from train's) and
    the tokenizer under `out`; return its path."""
    if n_train < 1 or n_heldout < 1:
        raise DataError(f"--n {n_train} and --heldout {n_heldout}: both must be >= 1")
    if kind not in TASK_KINDS:
        raise DataError(f"--kind {kind!r}: choose one of {', '.join(TASK_KINDS)}")
    words = distinct_words(n_train + n_heldout, seed, min_len, max_len)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    items = [TASK_KINDS[kind](w) for w in words]
    for name, part in ((HELDOUT_FILE, items[:n_heldout]), (TRAIN_FILE, items[n_heldout:])):
        (root / name).write_text("".join(json.dumps(item) + "\n" for item in part), encoding="utf-8")
    # The tokenizer has no merges, so it does not depend on these texts: every kind writes the same one.
    texts = [item["prompt"] + item.get("response", item.get("chosen")) for item in items]
    train_bpe(texts, TASK_VOCAB_SIZE, root / TOKENIZER_SUBDIR, progress=False, chat=True)
    return root
