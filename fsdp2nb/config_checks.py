"""Checks shared by the validated configs (engine, checkpointer, pool): each names the field,
the value and what is allowed."""

from __future__ import annotations

from typing import Any


def check_choice(field: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """Raise ValueError naming `field`, `value` and `allowed` when `value` is not allowed."""
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed; choose one of {allowed}")


def check_bool(field: str, value: Any) -> None:
    """Raise ValueError unless `value` is a real bool (1 and "yes" are rejected, not coerced)."""
    if not isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not allowed; choose one of (True, False)")
