"""The one exception type of the data pipeline."""

from __future__ import annotations

from ..utils.errors import UserError


class DataError(UserError):
    """Bad data input or a damaged/mismatched prepared dataset.

    Messages name the offending file and say how to fix it, so users can act without reading code.
    """
