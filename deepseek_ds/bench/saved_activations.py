"""The activations autograd keeps for backward, counted as they are saved and released (a pipeline stage's peak
activation memory in `bench pipeline`), and the storage key both it and the worker's held-bytes count use."""

from __future__ import annotations

import threading

import torch


def storage_key(t: torch.Tensor) -> tuple[str, int, int] | None:
    """(device, address, bytes) of the storage under `t`: distinct storages are counted once; None where it has
    none worth counting."""
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return str(t.device), storage.data_ptr(), storage.nbytes()


class SavedActivations:
    """While entered: the bytes of the distinct storages autograd keeps for backward (torch's saved-tensor hooks),
    now and at their peak. The parameters' storages (a matmul saves its weight, or a view of it) are the model's,
    not activations; what a checkpointed region saves inside it is torch's own business (its inputs and recomputed
    tensors are not seen), and so are the pipeline's receive buffers. A storage is released when the last saved
    tensor on it is: that can happen on autograd's thread, hence the lock."""

    def __init__(self, params):
        self.now = self.peak = 0
        self._params = {storage_key(p) for p in params}
        self._live: dict[tuple, list[int]] = {}  # storage -> [bytes, saved tensors on it]
        self._lock = threading.RLock()
        self._hooks = None

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        key = storage_key(t)
        if key is None or key in self._params:
            return t
        with self._lock:
            entry = self._live.setdefault(key, [key[2], 0])
            if entry[1] == 0:
                self.now += key[2]
                self.peak = max(self.peak, self.now)
            entry[1] += 1
        # Detached: a saved output whose hook keeps it with its grad_fn is a cycle through its own node, which
        # outlives a graph that a backward with retain_graph (zb-h1's input half) leaves behind.
        return _Saved(self, key, t.detach())

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: tuple) -> None:
        with self._lock:
            entry = self._live[key]
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self._live[key]


class _Saved:
    """One saved tensor, reporting its release (autograd drops it with the node that saved it)."""

    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: SavedActivations, key: tuple, tensor: torch.Tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        self.owner.release(self.key)
