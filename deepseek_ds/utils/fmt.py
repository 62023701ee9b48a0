"""Numbers and tables for people: byte sizes (written and read), plain-text and markdown tables (through
tabulate)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from tabulate import tabulate

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(GIB|GB|MIB|MB|TIB|TB)?", re.IGNORECASE)
_UNITS = {"GIB": 2**30, "GB": 2**30, "MIB": 2**20, "MB": 2**20, "TIB": 2**40, "TB": 2**40, None: 1}


def parse_bytes(text: str) -> int | None:
    """'80GB' -> bytes (GB means GiB, as GPU and host memory are quoted: an "80 GB" H100 holds 79.6 GiB); None
    when `text` is not a size."""
    m = _SIZE.fullmatch(text.strip())
    return int(float(m.group(1)) * _UNITS[m.group(2).upper() if m.group(2) else None]) if m else None


def human_bytes(n: float | None) -> str:
    """Binary units, two decimals: 1.50 GiB; "-" for an unknown value."""
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _align(headers: Sequence[str], align: Sequence[str] | None) -> tuple[str, ...]:
    # The first column names the row (left), the others are numbers (right), unless said otherwise.
    return tuple(align) if align else ("left",) + ("right",) * (len(headers) - 1)


def text_table(rows: Sequence[Sequence[str]], headers: Sequence[str], align: Sequence[str] | None = None) -> str:
    """Columns separated by two spaces under a dashed rule. Cells are printed as given (already formatted)."""
    return tabulate(rows, headers=list(headers), tablefmt="simple", colalign=_align(headers, align),
                    disable_numparse=True)


def markdown_table(rows: Sequence[Sequence[str]], headers: Sequence[str], align: Sequence[str] | None = None) -> str:
    """A GitHub markdown (pipe) table of already formatted cells."""
    return tabulate(rows, headers=list(headers), tablefmt="pipe", colalign=_align(headers, align),
                    disable_numparse=True)
