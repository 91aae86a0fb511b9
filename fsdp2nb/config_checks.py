"""Checks shared by the validated configs (engine, checkpointer, pool): each names the field,
the value and what is allowed."""

from __future__ import annotations

from typing import Any

from fsdp2nb.errors import InvalidValue


def check_choice(field: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """Raise InvalidValue (a ValueError) naming `field`, `value` and `allowed` when `value` is not allowed."""
    if value not in allowed:
        raise InvalidValue(f"{field}={value!r} is not allowed; choose one of {allowed}")


def check_bool(field: str, value: Any) -> None:
    """Raise InvalidValue (a ValueError) unless `value` is a real bool (1 and "yes" are rejected, not coerced)."""
    if not isinstance(value, bool):
        raise InvalidValue(f"{field}={value!r} is not allowed; choose one of (True, False)")
