"""`data prepare --hostfile`: one prepare split over the hosts that share its output directory.

The launching host plans (scan, split, the tokenizer trained or imported once, before any host starts) and deals
the shards still missing over the hosts, each host's share pickled to SHARES_DIR/host-NNN.pkl; every host then
tokenizes its share with its own workers (`python -m deepseek_ds.data.hosts SHARES_DIR`, started once a host by the
launcher); the launching host writes meta.json once every shard is on disk. A shard's bytes depend on its task only
and each is published atomically, so the output is byte-identical to a one-host prepare, and a host that dies
leaves its finished shards behind: the re-run deals only the missing ones.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from ..utils.errors import run_command
from ..utils.fs import write_bytes_atomic
from .errors import DataError
from .prepare import Planned, finish, run_tasks, worker_pool
from .shards import ShardTask, is_done, written_record

SHARES_DIR = ".hosts"  # under the output directory; removed with the last step, once meta.json is written
_POLL_S = 1.0


def deal(tasks: list[ShardTask], hosts: int) -> list[list[ShardTask]]:
    """Largest shard first to the least-loaded host (in bytes of text): shares within one shard of each other."""
    loads, shares = [0] * hosts, [[] for _ in range(hosts)]
    for task in sorted(tasks, key=lambda t: (-int(t.docs.size.sum()), t.name)):
        k = min(range(hosts), key=loads.__getitem__)
        shares[k].append(task)
        loads[k] += int(task.docs.size.sum())
    return shares


def write_shares(prep: Planned, hosts: int) -> tuple[Path, list[ShardTask]]:
    """Each host's share of the shards not yet done (a re-run's done ones are verified, as a one-host re-run
    verifies them); returns the shares' directory and the shards to do."""
    todo = [t for t in prep.tasks if not is_done(t)]
    shares_dir = prep.out / SHARES_DIR
    shutil.rmtree(shares_dir, ignore_errors=True)  # an earlier launch's
    shares_dir.mkdir()
    for k, share in enumerate(deal(todo, hosts)):
        write_bytes_atomic(_share_path(shares_dir, k),
                           pickle.dumps({"hosts": hosts, "workers": prep.workers, "tasks": share}))
    return shares_dir, todo


def _share_path(shares_dir: Path, index: int) -> Path:
    return shares_dir / f"host-{index:03d}.pkl"


@contextlib.contextmanager
def shard_progress(todo: list[ShardTask], hosts: int) -> Iterator[None]:
    """A bar on the launching host of the shards every host has written so far (their records, polled)."""
    stop = threading.Event()

    def poll() -> None:
        with tqdm(total=len(todo), unit="shard", desc=f"tokenizing on {hosts} host{'s' * (hosts != 1)}") as bar:
            left = list(todo)
            while left and not stop.wait(_POLL_S):
                left = [t for t in left if written_record(t) is None]
                bar.update(len(todo) - len(left) - bar.n)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def finish_shares(prep: Planned, shares_dir: Path) -> str:
    """meta.json once every shard is on disk; the shares' directory removed with it."""
    missing = [t.name for t in prep.tasks if written_record(t) is None]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise DataError(f"{len(missing)} of {len(prep.tasks)} shards of {prep.out} are missing ({shown}): a host "
                        "failed (its output is above); re-run the same command: it prepares only the missing shards")
    out = finish(prep)
    shutil.rmtree(shares_dir, ignore_errors=True)
    return out


def run_share(shares_dir: Path, index: int) -> str:
    """On host `index`: tokenize its share with its own workers; returns the line it prints."""
    path = _share_path(shares_dir, index)
    if not path.is_file():
        raise DataError(f"{socket.gethostname()} does not see {path}, which the launching host wrote: the output "
                        "directory must be one directory that every host mounts at the same path (NFS, Lustre, ...)")
    share = pickle.loads(path.read_bytes())  # written by this toolkit's launching host, for this run
    tasks = share["tasks"]
    unseen = sorted({s.path for t in tasks for s in t.docs.sources if not os.path.exists(s.path)})
    if unseen:
        raise DataError(f"{socket.gethostname()} does not see the input {unseen[0]}" + (
            f" (and {len(unseen) - 1} more)" if len(unseen) > 1 else "") + ": inputs must be on storage that every "
            "host mounts at the same path")
    start = time.perf_counter()
    with worker_pool(min(share["workers"], len(tasks))) as pool:
        done = run_tasks(tasks, pool, progress=False)
    seconds = time.perf_counter() - start
    tokens = sum(written_record(t)["num_tokens"] for t in tasks)
    return (f"host {index + 1} of {share['hosts']}: {done} shards, {tokens:,} tokens in "
            f"{seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s)")


def host_index() -> int:
    """This host's place in the launch: its RANK (one process a host under the deepspeed launcher) or SLURM_NODEID
    (srun, one task a node)."""
    for name in ("RANK", "SLURM_NODEID"):
        if name in os.environ:
            return int(os.environ[name])
    raise DataError("no RANK or SLURM_NODEID: this module runs on each host under `data prepare --hostfile`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tokenize this host's share of a `data prepare --hostfile`")
    parser.add_argument("shares_dir", type=Path)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = parser.parse_args(argv)
    return run_command(lambda: print(run_share(args.shares_dir, host_index()), flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
