"""Training objectives: train.objective -> the object that says what data a step takes and gives its loss and named
metrics (objectives/base.py). Each run holds its own (Run.objective, made by make_objective), with what the objective
keeps across steps; the loop never branches on the objective. A new objective is one more entry here."""

from __future__ import annotations

from types import MappingProxyType

from .base import Objective
from .dpo import DPO
from .grpo import GRPO
from .lm import NextToken

# config/schema.py's OBJECTIVES lists the same names for the config check (config sits below training).
OBJECTIVES = MappingProxyType({o.name: o for o in (NextToken, DPO, GRPO)})


def make_objective(name: str) -> Objective:
    """A run's objective for train.objective `name` (the config checked the name)."""
    return OBJECTIVES[name]()
