"""The run's checkpoint engine: one subclass of DeepSpeed's TorchCheckpointEngine, put in place of the plain one
DeepSpeed made the first time a save or resume asks for it (checkpoint_io), and kept for the engine's life. DeepSpeed
writes and reads every model, optimizer and layer file through its checkpoint engine's save() and load(), so this is
the one place the project's file handling meets DeepSpeed's:
- save(), while a save records (recording()): each file is written through the save's Writes (saving.py: checksummed
  as it is written, or kept for checkpoint.async's writer), AutoEP's frozen expert files as markers
  (frozen_experts.py);
- load(), while a resume loads (loading()): each file is read through VerifiedLoads (verified_load.py: checksummed on
  another core, memory-mapped, deserialized once), and a marker read back as the module's own experts.
Outside those blocks it is DeepSpeed's engine unchanged. Another (synchronous) engine DeepSpeed was configured with
(its checkpoint.writer) keeps its own save and load, wrapped for the block: its files are read back for their
records, and markers are written and read the same way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ..utils.private_api import TORCH_SAVE_ZIPFILE, instance_method_replaced
from .frozen_experts import ExpertsFromModule, marker_for


class RunCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch engine, whose save() and load() go through the save's or resume's own handling while one
    runs (see the module doc)."""

    def __init__(self, made: TorchCheckpointEngine):
        # DeepSpeed's settings as it made them (its __init__ would read them from the engine's config, and log again)
        vars(self).update(vars(made))
        self.writes = None  # saving.Writes while a save records
        self.frozen_experts = False  # while a save records: AutoEP's expert files as markers
        self.verified = None  # verified_load.VerifiedLoads while a resume verifies what it loads
        self.experts: ExpertsFromModule | None = None  # while a resume loads: markers as the module's experts

    def save(self, state_dict, path: str):
        if self.writes is None:
            return super().save(state_dict, path)
        # The same torch.save, through the save's Writes (checksummed as written, or deferred).
        self.writes.save(_content(state_dict, path, self.frozen_experts), str(path),
                         **{TORCH_SAVE_ZIPFILE: self.zipfile_serialization})
        return None

    def load(self, path: str, map_location=None):
        state = (self.verified.load(path, map_location) if self.verified is not None
                 else super().load(path, map_location))
        return self.experts.read(state, path) if self.experts is not None else state


def checkpoint_io(engine) -> CheckpointEngine:
    """The engine's checkpoint engine: DeepSpeed's plain torch engine is replaced by RunCheckpointEngine once (the
    engine reads engine.checkpoint_engine at each save and load); another engine is returned as it is."""
    made = engine.checkpoint_engine
    if type(made) is TorchCheckpointEngine:
        engine.checkpoint_engine = RunCheckpointEngine(made)
    return engine.checkpoint_engine


def verifies_loads(engine) -> bool:
    """Whether a resume can read through VerifiedLoads: only the torch engine reads files with a plain torch.load
    that it can stand in for."""
    return isinstance(checkpoint_io(engine), RunCheckpointEngine)


def _content(state_dict, path, frozen_experts: bool):
    return (marker_for(path) if frozen_experts else None) or state_dict


@contextlib.contextmanager
def recording(engine, writes, frozen_experts: bool = False) -> Iterator[None]:
    """The files DeepSpeed's checkpoint engine writes on this rank while the block runs (its save() is the one place
    every model, optimizer and layer file goes through), into `writes` (saving.Writes): through it, checksummed as
    they are written, with the torch engine; another engine's files are read back (writes.others).
    frozen_experts: AutoEP's expert files are written as frozen_experts.py's markers."""
    io = checkpoint_io(engine)
    if isinstance(io, RunCheckpointEngine):
        io.writes, io.frozen_experts = writes, frozen_experts
        try:
            yield
        finally:
            io.writes, io.frozen_experts = None, False
        return

    def save(state_dict, path):
        original(_content(state_dict, path, frozen_experts), path)
        writes.others.append(str(path))

    with instance_method_replaced(io, "save", save) as original:
        yield


@contextlib.contextmanager
def loading(engine, module, verified=None) -> Iterator[None]:
    """While DeepSpeed's load_checkpoint runs: marker files read as `module`'s own experts, and with `verified`
    (verified_load.VerifiedLoads; the torch engine only) every file is read through it."""
    io, experts = checkpoint_io(engine), ExpertsFromModule(module)
    if isinstance(io, RunCheckpointEngine):
        io.verified, io.experts = verified, experts
        try:
            yield
        finally:
            io.verified, io.experts = None, None
            if verified is not None:
                verified.release()
        return

    def load(path, *args, **kwargs):
        return experts.read(original(path, *args, **kwargs), path)

    with instance_method_replaced(io, "load", load) as original:
        yield
