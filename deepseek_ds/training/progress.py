"""Rank 0's progress display: a tqdm bar on a terminal; in a redirected log (Slurm, nohup), where a bar's
carriage returns make one line of thousands of characters, a plain line every `train.log_interval` steps."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from .metrics import console_line


class Progress:
    def __init__(self, total: int, initial: int, enabled: bool, interval: int, log: logging.Logger, stream=None):
        stream = stream or sys.stderr  # where tqdm draws
        self.total, self.interval, self.log = total, interval, log
        self.plain = enabled and not stream.isatty()
        self.bar = tqdm(total=total, initial=initial, disable=not enabled or self.plain, desc="train", unit="step",
                        dynamic_ncols=True, file=stream)

    def update(self, step: int, record: dict) -> None:
        line = console_line(record)
        self.bar.set_postfix_str(line, refresh=False)
        self.bar.update(1)
        if self.plain and (step % self.interval == 0 or step == self.total):
            self.log.info("step %d/%d  %s", step, self.total, line)

    def close(self) -> None:
        self.bar.close()
