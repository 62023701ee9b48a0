"""All-reduce bandwidth between the ranks of one launch (used by `deepseek-ds preflight --bandwidth`).

    deepspeed --hostfile hostfiles/4node deepseek_ds/launcher/allreduce_bench.py [--size-mb 256]

nccl on GPUs, gloo on CPU. Rank 0 prints "allreduce_bench: ready" once every rank has joined and
then one result line, "DSBW {json}", with the bus bandwidth: size * 2(n-1)/n / time, the traffic
each rank moves in a ring all-reduce. It is the figure nccl-tests reports, comparable across world
sizes and against the link speed. A rank that loses a peer fails within --timeout-s instead of
waiting for torch's 30-minute default.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

RESULT_MARKER = "DSBW "
READY_LINE = "allreduce_bench: ready"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=64.0, help="MiB per all-reduce")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduces")
    parser.add_argument("--warmup", type=int, default=2, help="untimed all-reduces first (connection set-up)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="collective timeout")
    parser.add_argument("--local_rank", type=int, help="passed by the deepspeed launcher; LOCAL_RANK is used")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    # Zeros stay zeros however often they are summed: no overflow to inf over a long run.
    data = torch.zeros(int(args.size_mb * 2**20) // 4, dtype=torch.float32, device=device)
    for _ in range(args.warmup):
        dist.all_reduce(data)
    synchronize(device)
    if rank == 0:
        print(f"{READY_LINE} world_size={world} backend={backend}", flush=True)

    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(data)
    synchronize(device)
    # The slowest rank defines the collective's time.
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    seconds = elapsed.item()
    size = data.numel() * data.element_size()
    algbw = size * args.iters / seconds / 1e9
    if rank == 0:
        result = {"world_size": world, "backend": backend, "size_bytes": size, "iters": args.iters,
                  "seconds": round(seconds, 4), "algbw_gbps": round(algbw, 3),
                  "busbw_gbps": round(algbw * 2 * (world - 1) / world, 3)}
        print(RESULT_MARKER + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
