"""Byte counts as people read them; shared by the dashboard, memory plans and rank errors (no torch)."""

from __future__ import annotations


def size(num_bytes: int) -> str:
    """`512 MiB`, `1.5 GiB`: binary units, three significant figures."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
