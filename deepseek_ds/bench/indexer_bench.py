"""`deepseek-ds bench indexer`: the peak memory of DeepSeek-V3.2's trainable lightning indexer
(models/deepseek_v32/indexer.py) in training, against the fp32 [B, S, H_I, T] scores that transformers' formula
materialises whole (B S H_I T x 4 bytes: about 16 GiB per sample at 8K tokens with the released 64 index heads).

One tiny-v32 attention layer (its index heads, head dim and top-k set by the flags), its indexer made trainable by
the product's own train_indexers (stage warmup or sparse): the indexer's forward on a random hidden state with the
family's causal mask, then the backward of its KL sum, as one training step runs them for one layer. Each row runs in
a fresh process, because a process's resident set never gives back its peak; in it glibc's malloc returns every
block of 1 MiB or more to the OS when freed (mallopt M_MMAP_THRESHOLD, which also ends its sliding threshold), so that
the resident set follows the live tensors rather than malloc's cache of freed query blocks. Measured: the peak
resident set above the one just before the forward (training.metrics' VmHWM reset through /proc/self/clear_refs,
as the training loop's memory_gb), what stays resident after the forward (what autograd and the checkpointed query
blocks hold for the backward) and the time; the memory does not depend on the host's load (other processes' memory
is not in this one's resident set), the time does. `one block` rows run the same indexer with chunk_elements at least S x
H_I x T, so that the whole score tensor exists at once: what the blocks save.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import psutil
import torch
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

from ..models.deepseek_v32 import FAMILY
from ..models.deepseek_v32.indexer import TrainableIndexer, train_indexers
from ..models.pipeline import prepare_config
from ..models.presets import build_model_config
from ..training.metrics import peak_memory_bytes, reset_peak_memory
from ..utils.cli_args import positive_int, spellings
from ..utils.errors import UserError, run_command
from ..utils.fmt import human_bytes
from . import report
from .load import HostLoad, add_allow_busy, check_quiet_host
from .report import Column

COLUMNS = [
    Column("seq_len", "tokens", "{:,d}"), Column("stage", "stage"), Column("blocks", "query blocks", "{:,d}"),
    Column("whole_bytes", "whole [B,S,H_I,T] fp32", "bytes"), Column("peak_bytes", "peak (fwd + bwd)", "bytes"),
    Column("peak_share", "peak / whole", "{:.0%}"), Column("held_bytes", "held after fwd", "bytes"),
    Column("working_bytes", "peak - held", "bytes"),
    Column("seconds", "fwd + bwd (s)", "{:.1f}"),
]
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
FREED_TO_OS = 2**20


def _return_freed_blocks() -> None:
    """glibc: serve (and free) every allocation of FREED_TO_OS bytes or more with its own mapping. Without this its
    threshold rises to each freed block's size (up to 32 MiB) and freed query blocks stay resident in the heap, which
    the peak would count."""
    libc = ctypes.util.find_library("c")
    if libc is None or not ctypes.CDLL(libc).mallopt(M_MMAP_THRESHOLD, FREED_TO_OS):
        raise UserError("bench indexer measures the resident set with glibc's malloc (mallopt), which this "
                        "platform lacks", hint="run it on Linux with glibc")


def model_config(args: argparse.Namespace):
    return prepare_config(build_model_config("tiny-v32", None, {
        "index_n_heads": args.index_heads, "index_head_dim": args.index_head_dim, "index_topk": args.index_topk,
        "max_position_embeddings": max(args.seq_lens)}))


def measure_row(args: argparse.Namespace, seq_len: int, stage: str, one_block: bool) -> dict:
    """One row, in its own process: the indexer's forward and backward at `seq_len` tokens (batch args.batch)."""
    _return_freed_blocks()
    mcfg = model_config(args)
    torch.manual_seed(0)
    attn = v32.DeepseekV32Attention(mcfg, 0)
    train_indexers(attn, stage)
    attn.train()
    indexer: TrainableIndexer = attn.indexer
    b, s, heads = args.batch, seq_len, max(mcfg.index_n_heads, mcfg.num_attention_heads)
    if one_block:
        indexer.chunk_elements = b * heads * s * s
    hidden = torch.randn(b, s, mcfg.hidden_size)
    position_ids = torch.arange(s).expand(b, s)
    kwargs = FAMILY.layer_kwargs(mcfg, v32.DeepseekV32RotaryEmbedding(mcfg), hidden, position_ids, None)
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    mask = kwargs["attention_mask"][:, 0]  # the [B, S, T] mask DeepseekV32Attention hands its indexer
    cpu = torch.device("cpu")
    before = psutil.Process().memory_info().rss
    reset_peak_memory(cpu)
    start = time.perf_counter()
    selected = indexer(hidden, q_resid, kwargs["position_embeddings"], mask)
    held = psutil.Process().memory_info().rss - before
    indexer.kl_sum.backward()
    seconds = time.perf_counter() - start
    peak = peak_memory_bytes(cpu) - before
    del selected
    rows = max(1, indexer.chunk_elements // (b * heads * s))
    return {"seq_len": s, "stage": stage + (", one block" if one_block else ""), "blocks": -(-s // rows),
            "whole_bytes": b * s * mcfg.index_n_heads * s * 4, "peak_bytes": peak,
            "peak_share": peak / (b * s * mcfg.index_n_heads * s * 4), "held_bytes": held,
            "working_bytes": peak - held, "seconds": seconds,
            "threads": torch.get_num_threads()}


def plans(args: argparse.Namespace) -> list[tuple[int, str, bool]]:
    out = [(s, stage, False) for s in args.seq_lens for stage in args.stages]
    return out + [(s, "sparse", True) for s in args.seq_lens if s <= args.one_block_up_to]


def run_indexer_bench(args: argparse.Namespace) -> list[dict]:
    rows = []
    for seq_len, stage, one_block in plans(args):
        print(f"{seq_len} tokens, {stage}{' (one block)' if one_block else ''} ...", flush=True)
        # A fresh process per row (max_tasks_per_child=1): its peak starts from nothing that an earlier row held.
        with ProcessPoolExecutor(1, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
            rows.append(pool.submit(measure_row, args, seq_len, stage, one_block).result())
    return rows


def verdict(rows: list[dict]) -> str:
    """The issue's criterion, for each length: the chunked rows' peaks against the whole tensor."""
    lines = []
    for s in sorted({r["seq_len"] for r in rows}):
        chunked = [r for r in rows if r["seq_len"] == s and "one block" not in r["stage"]]
        worst = max(chunked, key=lambda r: r["peak_bytes"])
        below = worst["peak_bytes"] < worst["whole_bytes"]
        lines.append(f"{s} tokens: the largest chunked peak ({worst['stage']}) {human_bytes(worst['peak_bytes'])} is "
                     f"{'below' if below else 'NOT below'} the whole tensor's {human_bytes(worst['whole_bytes'])}")
    return "\n".join(lines)


def reading(rows: list[dict], batch: int, topk: int) -> str:
    """What the table says, in numbers taken from it: the working set stays a few query blocks at every length, and
    what the blocks keep for the backward grows with the length, not with its square."""
    s = max(r["seq_len"] for r in rows)
    chunked = [r for r in rows if "one block" not in r["stage"]]
    block = TrainableIndexer.chunk_elements * 4
    held = {r["stage"]: r["held_bytes"] for r in chunked if r["seq_len"] == s}
    return (f"Reading the table: `peak - held` (the backward of one query block and its forward's transients) stays "
            f"{human_bytes(min(r['working_bytes'] for r in chunked))} to "
            f"{human_bytes(max(r['working_bytes'] for r in chunked))} at every length, about "
            f"{max(r['working_bytes'] for r in chunked) / block:.1f} blocks of chunk_elements x 4 bytes "
            f"({human_bytes(block)}), whatever the index heads: the whole tensor, B S H_I T x 4 bytes, grows with "
            f"them (the released model's 64 heads make it {human_bytes(batch * s * 64 * s * 4)} at {s:,} tokens). "
            f"Below about 3 blocks' worth of whole tensor the blocks cannot win (the shortest rows). `held after fwd` "
            f"grows with the length, per token a constant: the rotated queries and keys, head weights, the main "
            f"attention's queries and keys the blocks recompute p from, and in the sparse stage the chosen keys "
            f"(int32, top-k per query: {human_bytes(4 * batch * s * min(topk, s))} of the sparse row's "
            f"{human_bytes(held.get('sparse', 0))} at {s:,} tokens); neither p nor the selectable keys are kept.")


def _bench(args: argparse.Namespace) -> int:
    if args.out:
        check_quiet_host(args.allow_busy)
    mcfg = model_config(args)
    with HostLoad(own_tasks=torch.get_num_threads()) as load:
        rows = run_indexer_bench(args)
    table = report.markdown_table(rows, COLUMNS)
    summary = verdict(rows) + "\n\n" + reading(rows, args.batch, args.index_topk)
    print(table)
    print(summary)
    if args.out:
        path = os.path.join(args.out, "indexer-memory.md")
        what = (f"tiny-v32 with {mcfg.index_n_heads} index heads of {mcfg.index_head_dim} (H_I), top-k "
                f"{mcfg.index_topk}, {mcfg.num_attention_heads} attention heads, batch {args.batch}, fp32; one "
                f"attention layer's trainable indexer, forward and the backward of its KL sum (chunk_elements "
                f"{TrainableIndexer.chunk_elements:,} fp32 elements per query block, models/loss.CHUNK_LOGITS). "
                + __doc__.split("\n\n", 1)[1].replace("\n", " ").strip())
        report.write_process_report(path, "DeepSeek-V3.2's trainable indexer: peak memory against the whole score "
                                    "tensor", what, [table, summary], load=load)
        print(f"wrote {path}")
    return 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(*spellings("--seq-lens"), type=positive_int, nargs="+", default=[2048, 4096, 8192],
                   help="sequence lengths, one row each per stage (default 2048 4096 8192)")
    p.add_argument("--stages", nargs="+", choices=["warmup", "sparse"], default=["warmup", "sparse"],
                   help="indexer.stage of the rows (default both)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument(*spellings("--index-heads"), type=positive_int, default=16,
                   help="index_n_heads (H_I; the released model has 64; default 16, light enough for a 2-core CPU "
                        "host at 8K tokens)")
    p.add_argument(*spellings("--index-head-dim"), type=positive_int, default=32,
                   help="index_head_dim (the released model has 128; default 32)")
    p.add_argument(*spellings("--index-topk"), type=positive_int, default=2048,
                   help="index_topk, keys each query keeps in the sparse stage (default 2048, the released model's)")
    p.add_argument(*spellings("--one-block-up-to"), type=int, default=4096, metavar="S",
                   help="also run the sparse stage in one block (the whole tensor at once) up to S tokens (default "
                        "4096; its peak is about 3 whole tensors: some 12 GiB at 8K tokens and 16 heads)")
    p.add_argument("--out", default=None, help="write the report OUT/indexer-memory.md (default: print only)")
    add_allow_busy(p)
    p.set_defaults(func=_bench)


def register(subparsers) -> None:
    """Add `indexer` to the `deepseek-ds bench` sub-command group."""
    _add_arguments(subparsers.add_parser(
        "indexer", help="peak memory of DeepSeek-V3.2's trainable indexer (forward + backward, query blocks) vs the "
                        "whole [B, S, H_I, T] score tensor"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepseek_ds.bench.indexer_bench", description=__doc__)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return run_command(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
