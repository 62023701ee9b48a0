"""Each rank's communication bytes per optimizer step, by collective kind, counted on a real run.

Where: every collective goes through one of two doors. DeepSpeed's (its engine, ZeRO, AutoEP, AutoTP, Ulysses) is
deepspeed.comm, whose functions all call the one backend object `deepspeed.comm.comm.cdb`; that object binds some
torch functions at start-up (all_gather_into_tensor, reduce_scatter_tensor), so patching torch.distributed alone
misses ZeRO-3's gathers. The toolkit's own calls (metrics, loss token counts, MoE and TP all-reduces, SP gathers)
go straight to torch.distributed. CommCounter wraps the backend object's methods and torch.distributed's public
functions; a call made inside another counted call (a backend method calling torch, all_gather_object calling
all_gather) counts once, as the outermost.

Bytes: the tensor bytes a call passes on this rank, numel x element size of
  all_reduce, reduce, broadcast: the tensor (its coalesced variants: the sum of the tensors);
  reduce_scatter: the whole input (every rank's shards), all_gather: the whole output (every rank's shards);
  all_to_all: the input; send/recv: the tensors this rank sends (isend, and batch_isend_irecv's isends; receives
  count on the sender); gather/scatter: this rank's tensor, and the list on the root.
A call over a group of this rank alone (ZeRO's reduction over a data-parallel group of one beside a pipeline or
expert parallelism) sends nothing and counts nothing. The wire traffic of an algorithm (a ring all-reduce sends
2 (n-1)/n of it) is the plan's concern (plan/comm.py).
Object collectives (all_gather_object, broadcast_object_list) carry pickles, not tensors: not counted (they are
start-up and checkpoint checks, never in a training step).

Per step: a call counts in step engine.global_steps + 1 at its time (`step_of`), so a step holds what ran from the
previous optimizer step's end to its own: its forward, backward, reductions and update, and the previous step's
metric reductions after the update."""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from deepspeed.comm import comm as ds_comm
from torch.distributed import distributed_c10d

from ..config import load_and_validate
from ..training.loop import train
from ..training.main import parse_args
from ..training.run import Run
from ..training.setup import build_run


def _bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _sum(ts) -> int:
    return sum(_bytes(t) for t in ts or ())


def _sends(ops) -> int:
    return sum(_bytes(op.tensor) for op in ops if "isend" in str(getattr(op.op, "__name__", op.op)))


def _arg(args: tuple, kwargs: dict, position: int, *names: str):
    """An argument by position or keyword: DeepSpeed's backend methods take torch's arguments in torch's order under
    other names (output_tensor for output), and some of its decorators hide their signatures."""
    if len(args) > position:
        return args[position]
    return next((kwargs[n] for n in names if n in kwargs), None)


def _one(position: int, *names: str) -> Callable:
    return lambda args, kwargs: _bytes(_arg(args, kwargs, position, *names))


def _many(position: int, *names: str) -> Callable:
    return lambda args, kwargs: _sum(_arg(args, kwargs, position, *names))


def _nothing(args, kwargs) -> int:
    return 0


# name -> (kind, its bytes from (args, kwargs), the position of its group argument); kind None: a door passed
# through uncounted (objects, receives).
_OPS: dict[str, tuple[str | None, Callable[[tuple, dict], int], int | None]] = {
    "all_reduce": ("all_reduce", _one(0, "tensor"), 2),
    "inference_all_reduce": ("all_reduce", _one(0, "tensor"), 2),
    "all_reduce_coalesced": ("all_reduce", _many(0, "tensors"), 2),
    "reduce": ("reduce", _one(0, "tensor"), 3),
    "broadcast": ("broadcast", _one(0, "tensor"), 2),
    "reduce_scatter": ("reduce_scatter", _many(1, "input_list"), 3),
    "reduce_scatter_tensor": ("reduce_scatter", _one(1, "input", "input_tensor"), 3),
    "all_gather": ("all_gather", _many(0, "tensor_list"), 2),
    "all_gather_into_tensor": ("all_gather", _one(0, "output_tensor"), 2),
    "all_gather_base": ("all_gather", _one(0, "output_tensor"), 2),
    "all_gather_coalesced": ("all_gather", _many(0, "output_tensors"), 2),
    "all_to_all_single": ("all_to_all", _one(1, "input"), 4),
    "all_to_all": ("all_to_all", _many(1, "input_tensor_list"), 2),
    "send": ("send_recv", _one(0, "tensor"), 2),
    "isend": ("send_recv", _one(0, "tensor"), 2),
    "recv": (None, _nothing, None),
    "irecv": (None, _nothing, None),
    "batch_isend_irecv": ("send_recv", lambda args, kwargs: _sends(_arg(args, kwargs, 0, "p2p_op_list")), None),
    "gather": ("gather", lambda args, kwargs: _bytes(_arg(args, kwargs, 0, "tensor"))
               + _sum(_arg(args, kwargs, 1, "gather_list")), 3),
    "scatter": ("scatter", lambda args, kwargs: _bytes(_arg(args, kwargs, 0, "tensor"))
                + _sum(_arg(args, kwargs, 1, "scatter_list")), 3),
    "all_gather_object": (None, _nothing, None),
    "broadcast_object_list": (None, _nothing, None),
    "gather_object": (None, _nothing, None),
    "scatter_object_list": (None, _nothing, None),
}


def _alone(args: tuple, kwargs: dict, position: int | None) -> bool:
    """The call's group is this rank alone (ZeRO's reduction over a data-parallel group of one): nothing is sent."""
    if position is None:
        return False
    group = _arg(args, kwargs, position, "group")
    return dist.get_world_size(group) == 1


class CommCounter:
    """with CommCounter(lambda: engine.global_steps) as counter: ... ; counter.steps[step][kind] = bytes, and
    counter.calls[step][kind] = calls, on this rank (see the module's docstring for what counts)."""

    def __init__(self, step_of: Callable[[], int]):
        self.step_of = step_of
        self.steps: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._inside = threading.local()
        self._patched: list[tuple[object, str, object, bool]] = []

    def _wrap(self, owner: object, name: str, instance: bool) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        kind, size, group_at = _OPS[name]

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if getattr(self._inside, "depth", 0) == 0 and kind is not None and not _alone(args, kwargs, group_at):
                step = self.step_of() + 1
                self.steps[step][kind] += size(args, kwargs)
                self.calls[step][kind] += 1
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        self._patched.append((owner, name, original, instance))
        setattr(owner, name, counted)

    def __enter__(self) -> CommCounter:
        backend = ds_comm.cdb
        for name in _OPS:
            if backend is not None:
                self._wrap(backend, name, instance=True)
            self._wrap(dist, name, instance=False)
        # torch's P2POp accepts only distributed_c10d's own isend/irecv (DeepSpeed's DualPipeV batches its sends as
        # P2POps of torch.distributed's): the counted ones stand in there too.
        for name in ("isend", "irecv"):
            self._patched.append((distributed_c10d, name, getattr(distributed_c10d, name), False))
            setattr(distributed_c10d, name, getattr(dist, name))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original, instance in reversed(self._patched):
            if instance:
                delattr(owner, name)  # the instance's copy: its class's method shows through again
            else:
                setattr(owner, name, original)
        self._patched.clear()

    def as_dict(self) -> dict:
        return {"bytes": {str(s): dict(k) for s, k in sorted(self.steps.items())},
                "calls": {str(s): dict(k) for s, k in sorted(self.calls.items())}}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)


def counts_file(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"comm.rank{rank}.json")


def counting(train_one: Callable[[Run], object] = train) -> Callable[[Run], object]:
    """`train_one(run)` (the real training loop by default) with every collective counted: each rank writes its
    counts to comm.rank<R>.json in the run's output_dir. Counting reads tensor sizes only: the run is unchanged."""
    def counted(run: Run):
        with CommCounter(lambda: run.engine.global_steps) as counter:
            result = train_one(run)
        counter.write(counts_file(run.cfg.train.output_dir, dist.get_rank()))
        return result
    return counted


def read_counts(path: str) -> dict[int, dict[str, int]]:
    """A rank's file from CommCounter.write: bytes by step, then kind."""
    with open(path) as f:
        return {int(s): k for s, k in json.load(f)["bytes"].items()}


def main(argv=None) -> int:
    """One rank of `bench comm`'s launch of a layout (train.py's arguments): the run built as training.main builds
    it, trained by the real loop, counted."""
    args = parse_args(argv)
    cfg, ds = load_and_validate(args.config, args.deepspeed_config, args.set, int(os.environ["WORLD_SIZE"]))
    os.makedirs(cfg.train.output_dir, exist_ok=True)
    counting()(build_run(cfg, ds))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # deepspeed --module deepseek_ds.bench.comm_counter (bench comm)
    sys.exit(main())
