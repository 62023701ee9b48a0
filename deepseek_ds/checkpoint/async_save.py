"""checkpoint.async: a save's state copied to host memory and then written, checksummed, flushed and published by a
background thread (saving.py's _complete) while training goes on.

The step is blocked only while DeepSpeed builds its state dicts (references to the live tensors, no bytes copied):
the copy runs in the writer thread, overlapping the next step's forward and backward, which only read that state.
DeepSpeed changes it first in its engine's model step (private_api.TAKE_MODEL_STEP: the optimizer and scheduler
steps, the step counters; its own decoupled engine commits there too), so the next update waits there until the copy
is done, as DataStates-LLM's lazy snapshot does; every other change of the state (a load, a synchronous save) waits
for the whole save first.

Our own writer, not DeepSpeed's decoupled checkpoint engine (checkpoint.writer.decoupled, which validate refuses):
that engine's save() silently drops the state when its writer process has died, its commit() (called inside
save_checkpoint) blocks the step until every file is written, and its FastPersist writer needs the async_io op.

The copy keeps torch.save's storage sharing (each storage copied once, every tensor a view of its copy at the same
offset and strides), so the files hold what a synchronous save writes. A GPU's storages go to pinned host buffers,
kept from one save to the next (one set of a rank's shards, reused), copied on a stream of the writer's own that
starts after the update which made the state. The writer's collectives run over a gloo process group of their own,
created once on every rank: they never interleave with the training step's on the default group.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..utils.private_api import TAKE_MODEL_STEP, replace_instance_method, restore_instance_method
from .format import CheckpointError

SAVE_FAILED = 2.0  # the value of a rank's stop flag (training/signals.py) once its background save failed


class PinnedBuffers:
    """Pinned host buffers by size, reused by the next save: allocating pinned memory costs far more than a copy."""

    def __init__(self):
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._used: list[torch.UntypedStorage] = []

    def take(self, nbytes: int) -> torch.UntypedStorage:
        free = self._free.get(nbytes)
        buffer = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
        self._used.append(buffer)
        return buffer

    def recycle(self) -> None:
        for buffer in self._used:
            self._free.setdefault(buffer.nbytes(), []).append(buffer)
        self._used = []


def host_copy(obj, pinned: PinnedBuffers | None = None, storages: dict | None = None):
    """A copy of a state dict in host memory: tensors (by storage, see the module doc; a GPU's into `pinned`), and the
    containers and small objects around them (copied too: DeepSpeed's dicts of scheduler and optimizer settings
    change as training goes on)."""
    storages = {} if storages is None else storages
    if isinstance(obj, torch.Tensor):
        source = obj.untyped_storage()
        key = (source.data_ptr(), source.nbytes(), source.device)
        if key not in storages:
            storages[key] = (source.clone() if source.device.type == "cpu" else
                             pinned.take(source.nbytes()).copy_(source, non_blocking=True))
        view = torch.empty(0, dtype=obj.dtype).set_(storages[key], obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):  # as torch.save would have written it
            return torch.nn.Parameter(view, requires_grad=obj.requires_grad)
        return view
    if isinstance(obj, dict):
        out = copy.copy(obj)  # the same class: OrderedDict, defaultdict
        for k, v in obj.items():
            out[k] = host_copy(v, pinned, storages)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(host_copy(v, pinned, storages) for v in obj)
    return copy.deepcopy(obj)


def device_point() -> tuple[int, torch.cuda.Event] | None:
    """In the step, on a GPU: (the device, an event after the work queued so far on this thread's stream: the update
    that made the state); None without one."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    event = torch.cuda.Event()
    event.record()
    return torch.cuda.current_device(), event


@contextlib.contextmanager
def copying_after(point: tuple[int, torch.cuda.Event] | None) -> Iterator[None]:
    """The block's device-to-host copies (host_copy, in the writer thread) on a GPU stream of their own that starts at
    `point` (device_point() in the step), all landed when the block ends."""
    if point is None:
        yield
        return
    device, event = point
    with torch.cuda.device(device):  # a new thread's current device is the first GPU, not this rank's
        stream = torch.cuda.Stream()
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()


class AsyncSaver:
    """One background save at a time on this rank. start() runs a save's copy, then its completion (its writes, the
    gather, the publication) in a thread over the saver's own process group, holding the engine's next update until
    the copy is done; wait() joins it and raises its failure; `failed` is set by a failure, for the training loop's
    stop flag (every rank then stops at the same step). `log`: rank 0's, which says when each save was published;
    None elsewhere."""

    def __init__(self, log: logging.Logger | None = None):
        self.group = dist.new_group(backend="gloo")  # every rank, at the same point of the start-up
        self.log = log
        self.pinned = PinnedBuffers()  # a GPU's host buffers, one set for this rank's saves (one at a time)
        self.failed = threading.Event()
        self._copied = threading.Event()
        self._held = None  # the engine whose next update waits for the copy
        self._thread: threading.Thread | None = None
        self._error: CheckpointError | None = None
        self._step = 0
        # The last save's: its time in the step, how long the next update waited for its copy, the copy's own time
        # (in the writer thread), and its time to published from its start.
        self.blocked_s = self.update_wait_s = self.copy_s = 0.0
        self.durable_s: float | None = None

    def start(self, step: int, engine, copy_state: Callable[[], None], complete: Callable[[object], None],
              blocked_s: float) -> None:
        """copy_state: the state to host memory (never raises: a failure is complete's to report on every rank)."""
        self._step, self.blocked_s, self.durable_s, self.update_wait_s = step, blocked_s, None, 0.0
        start = time.perf_counter() - blocked_s
        self._copied.clear()
        self._hold_next_update(engine)

        def run() -> None:
            try:
                try:
                    copy_start = time.perf_counter()
                    copy_state()
                finally:
                    self.copy_s = time.perf_counter() - copy_start
                    self._copied.set()
                complete(self.group)
                self.durable_s = time.perf_counter() - start
                if self.log:
                    self.log.info("saved checkpoint step %d in the background: the step was blocked %.2fs, the state "
                                  "copied in %.2fs meanwhile, the files durable and published after %.2fs", step,
                                  blocked_s, self.copy_s, self.durable_s)
            except Exception as e:  # every failure of the writer becomes the job's one line
                self._error = e if isinstance(e, CheckpointError) else CheckpointError(
                    f"the background save of step {step} failed: {type(e).__name__}: {e}",
                    "the previous checkpoint is intact; see this rank's log")
                self.failed.set()
            finally:
                self.pinned.recycle()

        # A daemon: a rank that fails elsewhere must exit without waiting for a writer blocked in a collective with
        # a dead peer; a kill at any moment of the publication leaves the previous tag (saving.py).
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _hold_next_update(self, engine) -> None:
        """The engine's next model step (the first change of the saved state, see the module doc) waits for
        the copy; the class's method again after it."""
        def take_model_step(*args, **kwargs):
            self._release()
            waited = time.perf_counter()
            self._copied.wait()
            self.update_wait_s = time.perf_counter() - waited
            if self.log and self.update_wait_s > 0.01:
                self.log.info("the update after the save of step %d waited %.2fs for its copy", self._step,
                              self.update_wait_s)
            return update(*args, **kwargs)

        update = replace_instance_method(engine, TAKE_MODEL_STEP, take_model_step)
        self._held = engine

    def _release(self) -> None:
        if self._held is not None:
            restore_instance_method(self._held, TAKE_MODEL_STEP)
            self._held = None

    def wait(self, step: int | None = None) -> None:
        """Block until the save in flight is published (or raise its failure); the log says how long the save of
        `step` waited for it."""
        self._release()  # the copy is done once the thread is
        if self._thread is None:
            return
        waited = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - waited
        self._thread = None
        if self._error is not None:
            raise self._error
        if self.log and step is not None and waited > 0.01:
            self.log.info("the save of step %d waited %.2fs for the background save of step %d", step, waited,
                          self._step)

    def error(self) -> CheckpointError:
        """The failure to raise on every rank once the stop flags said that some rank's save failed."""
        self._release()
        if self._thread is not None:
            self._thread.join()  # this rank's writer has the broadcast outcome, or is about to
        return self._error or CheckpointError(f"the background save of step {self._step} failed on another rank",
                                              "its log says why; the previous checkpoint is intact")
