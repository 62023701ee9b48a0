"""The references' own data order: which samples each training step reads and what tokens they hold, written from the
documented semantics (the module docstrings of deepseek_ds/data/sampler.py, packed.py and layout.py) and sharing
no code with deepseek_ds.data, so that an ordering, slicing or packing bug there cannot hide in a reference that
reads its batches the same way. test_data_sampler.py checks the toolkit's order against this one.

What is read from a prepared dataset (the on-disk format, deepseek_ds/data/layout.py, format_version 1):
meta.json's "dtype", "eos_id" and "splits"[split]["shards"] (in order, each "name" and "num_tokens"), and each
shard's <name>.bin, its flat little-endian token ids. Nothing else: not the .idx bounds, the checksums or the
tokenizer.

The semantics:
- the split's token stream is its shards' tokens one after the other;
- sample i is stream[i*S : i*S + S + 1] (S = seq_len), N = (len(stream) - 1) // S samples: consecutive samples share
  one token, documents (each ended by EOS) run across samples;
- a sample's input_ids are its first S tokens, its labels the last S;
- document_mask: position ids count from 0 at the sample's first token and at each token after an EOS input, and
  an EOS input's label (the next document's first token) is -100;
- global position p holds sample perm(p // N)[p % N], perm(e) being numpy's PCG64 permutation of range(N) seeded
  by the sequence [seed, e] (range(N) itself without shuffling): epochs follow each other seamlessly;
- training step k (1-based) of a run that starts with c samples consumed reads positions [c + (k-1)G, c + kG)
  (G = global batch size), whatever the layout;
- data-parallel rank r of D takes the contiguous G/D of them from r*G/D on, in micro-batches of M in order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

IGNORE_INDEX = -100


class StreamSamples:
    """The fixed-length samples of one split of a prepared text dataset, read straight from its files."""

    def __init__(self, data_dir: str, seq_len: int, split: str = "train", document_mask: bool = False):
        meta = json.loads((Path(data_dir) / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        pieces = []
        for shard in meta["splits"][split]["shards"]:
            tokens = np.fromfile(Path(data_dir) / f"{shard['name']}.bin", dtype=dtype)
            assert len(tokens) == shard["num_tokens"], (shard["name"], len(tokens), shard["num_tokens"])
            pieces.append(tokens.astype(np.int64))
        self.stream = np.concatenate(pieces)
        self.seq_len, self.eos, self.document_mask = seq_len, int(meta["eos_id"]), document_mask

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.seq_len

    def sample(self, i: int) -> tuple[torch.Tensor, ...]:
        """(input_ids, labels) of sample i, or (input_ids, labels, position_ids) with document_mask."""
        assert 0 <= i < len(self), (i, len(self))
        tokens = torch.from_numpy(self.stream[i * self.seq_len:(i + 1) * self.seq_len + 1].copy())
        inputs, labels = tokens[:-1], tokens[1:].clone()
        if not self.document_mask:
            return inputs, labels
        positions, count = [], 0
        for t in range(self.seq_len):
            if t > 0 and int(inputs[t - 1]) == self.eos:
                count = 0
            positions.append(count)
            count += 1
        labels[inputs == self.eos] = IGNORE_INDEX
        return inputs, labels, torch.tensor(positions)


def sample_at(position: int, num_samples: int, seed: int, shuffle: bool = True) -> int:
    """The sample at global position `position`."""
    epoch, offset = divmod(position, num_samples)
    if not shuffle:
        return offset
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return int(rng.permutation(num_samples)[offset])


def step_samples(step: int, num_samples: int, global_batch: int, seed: int, shuffle: bool = True,
                 consumed: int = 0) -> list[int]:
    """The samples of training step `step` (1-based) of a run that started with `consumed` samples consumed."""
    first = consumed + (step - 1) * global_batch
    return [sample_at(p, num_samples, seed, shuffle) for p in range(first, first + global_batch)]


def rank_micro_batches(samples: list[int], dp_rank: int, dp_size: int, micro_batch: int) -> list[list[int]]:
    """The micro-batches (sample ids) that data-parallel rank `dp_rank` computes of a global batch's samples."""
    share = len(samples) // dp_size
    mine = samples[dp_rank * share:(dp_rank + 1) * share]
    return [mine[j:j + micro_batch] for j in range(0, share, micro_batch)]


def stack(data: StreamSamples, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """The samples `ids` as one micro-batch: (input_ids, labels[, position_ids]), each [len(ids), seq_len]."""
    return tuple(torch.stack(column) for column in zip(*(data.sample(i) for i in ids)))


def step_batch(data: StreamSamples, step: int, global_batch: int, seed: int, shuffle: bool = True,
               micro_batch: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Training step `step`'s whole global batch in micro-batches of `micro_batch` (default: one), as one process
    with a data-parallel size of 1 reads it."""
    samples = step_samples(step, len(data), global_batch, seed, shuffle)
    return [stack(data, ids) for ids in rank_micro_batches(samples, 0, 1, micro_batch or global_batch)]


class ChatSamples:
    """The sequences of one split of a prepared chat dataset without packing, read straight from its files (layout.py:
    meta.json's "dtype", "eos_id" and the split's shards in order; each shard's .bin tokens, .idx int64 sample bounds
    and .mask uint8 per token, 1 where the loss is computed), as data/sft.py's module doc describes them: sample i is
    the i-th conversation of at most seq_len tokens (longer ones are dropped: data.truncation drop) padded with EOS;
    labels[t] is token t + 1 where that token's mask is 1, else -100 (so the last token and the padding predict
    nothing); position ids count 0..n-1 over the conversation, then 0.. again over the padding."""

    def __init__(self, data_dir: str, seq_len: int, split: str = "train"):
        meta = json.loads((Path(data_dir) / "meta.json").read_text())
        assert meta["format"] == "chat", meta.get("format")
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        self.seq_len, self.eos, self.conversations = seq_len, int(meta["eos_id"]), []
        for shard in meta["splits"][split]["shards"]:
            tokens = np.fromfile(Path(data_dir) / f"{shard['name']}.bin", dtype=dtype).astype(np.int64)
            bounds = np.fromfile(Path(data_dir) / f"{shard['name']}.idx", dtype="<i8")
            trained = np.fromfile(Path(data_dir) / f"{shard['name']}.mask", dtype=np.uint8)
            assert len(tokens) == len(trained) == bounds[-1] == shard["num_tokens"], shard["name"]
            self.conversations += [(tokens[a:b], trained[a:b]) for a, b in zip(bounds[:-1], bounds[1:])
                                   if b - a <= seq_len]

    def __len__(self) -> int:
        return len(self.conversations)

    def sample(self, i: int) -> tuple[torch.Tensor, ...]:
        """(input_ids, labels, position_ids) of sequence i."""
        tokens, trained = self.conversations[i]
        n, s = len(tokens), self.seq_len
        inputs = torch.full((s,), self.eos, dtype=torch.int64)
        labels = torch.full((s,), IGNORE_INDEX, dtype=torch.int64)
        inputs[:n] = torch.from_numpy(tokens)
        labels[:n - 1] = torch.from_numpy(np.where(trained[1:] == 1, tokens[1:], IGNORE_INDEX))
        return inputs, labels, torch.cat([torch.arange(n), torch.arange(s - n)])
