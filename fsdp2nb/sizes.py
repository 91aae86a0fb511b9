"""Byte counts as people read them; shared by the dashboard, memory plans and rank errors (no torch)."""

from __future__ import annotations

from fsdp2nb.errors import InvalidValue


def size(num_bytes: int) -> str:
    """`512 MiB`, `1.5 GiB`: binary units, three significant figures."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def mib(num_bytes: int, decimals: int = 0) -> str:
    """`1,234 MiB`: one fixed unit, for figures read side by side in a column."""
    return f"{num_bytes / 2**20:,.{decimals}f} MiB"


_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """Bytes from `80GiB`, `80G`, `80 GB`, `512MiB` or a plain number of bytes (units are binary:
    memory is sold that way); ValueError with one line saying what is accepted."""
    cleaned = text.strip().lower().replace(" ", "").removesuffix("ib").removesuffix("b")
    digits = cleaned.rstrip("kmgt")
    unit = cleaned[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value > 0 or value != value or value == float("inf"):
        raise InvalidValue(f"{text!r} is not a memory size; give a number with a unit, e.g. 80GiB, 80G or 512MiB")
    return int(value * _UNITS[unit])
