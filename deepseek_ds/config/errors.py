"""ConfigError and the helpers every section's `__post_init__` reports with (schema.py, objective_sections.py)."""

from __future__ import annotations

from ..utils.errors import UserError


class ConfigError(UserError):
    """A configuration problem; the message names the field and the fix."""


def refuse(problems: list[str]) -> None:
    """Raise one ConfigError listing every problem a section found (if any)."""
    if problems:
        raise ConfigError("\n".join(problems))


def at_least(section: str, minimum: int, **values: int) -> list[str]:
    return [f"{section}.{name} must be >= {minimum}" for name, value in values.items() if value < minimum]
