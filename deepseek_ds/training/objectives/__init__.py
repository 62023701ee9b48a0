"""Training objectives: train.objective -> the object that says what data a step takes and gives its loss and named
metrics (objectives/base.py). The loop asks objective_of(run) and never branches on the objective; a new objective
is one more entry here."""

from __future__ import annotations

from types import MappingProxyType

from ..setup import Run
from .base import Objective
from .dpo import DPO
from .grpo import GRPO
from .lm import NextToken

# config/schema.py's OBJECTIVES lists the same names for the config check (config sits below training).
OBJECTIVES = MappingProxyType({o.name: o for o in (NextToken(), DPO(), GRPO())})


def objective_of(run: Run) -> Objective:
    """The run's objective, by train.objective (the config checked the name)."""
    return OBJECTIVES[run.cfg.train.objective]
