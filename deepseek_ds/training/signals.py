"""Stopping on a signal at a step boundary, on every rank at once."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class StopOnSignal:
    """SIGTERM (a scheduler's preemption; the deepspeed launcher forwards it, then kills after 30 s) and SIGINT
    (Ctrl-C) only set a flag. The training loop asks `requested()` after every step; it is a collective, so all
    ranks stop after the same step, save, and exit normally. A repeated signal changes nothing: the launcher
    sends SIGTERM right after a Ctrl-C's SIGINT, and dying mid-save would waste the stop."""

    def __init__(self, device: torch.device):
        self.device = device
        self.received: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
