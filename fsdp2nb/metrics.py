"""`fsdp2nb.log(step, **values)`: training metrics a rank records for the dashboard.

Points wait here until the sampler thread sends them with its next snapshot (about 2 Hz), or the
rank with its own at the end of the request (so a cell's points reach the kernel before its
reply), so a training loop pays for a lock and an append, never for a message. The buffer is
bounded: a loop that logs faster than the sampler drains keeps its newest points.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from fsdp2nb.errors import InvalidValue
from fsdp2nb.wire.records import MetricPoint

MAX_PENDING_POINTS = 5_000


class MetricsBuffer:
    """Thread-safe queue of logged points between the training thread and the sampler."""

    def __init__(self, max_points: int = MAX_PENDING_POINTS) -> None:
        self._lock = threading.Lock()
        self._points: deque[MetricPoint] = deque(maxlen=max_points)

    def log(self, step: int, values: dict[str, float]) -> None:
        point = MetricPoint(step=int(step), time=time.time(), values=_numbers(values))
        with self._lock:
            self._points.append(point)

    def pending(self) -> bool:
        """Whether points wait to be sent."""
        with self._lock:
            return bool(self._points)

    def drain(self) -> tuple[MetricPoint, ...]:
        with self._lock:
            points = tuple(self._points)
            self._points.clear()
        return points


def _numbers(values: dict[str, object]) -> dict[str, float]:
    """Plain floats (a tensor's `.item()`), so the kernel never needs torch to read them."""
    numbers = {}
    for name, value in values.items():
        try:
            numbers[name] = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several values
            raise InvalidValue(f"{name}={_brief(value)} is not a number; log numbers or 1-element tensors") from None
    return numbers


def _brief(value: object) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 40 else f"{text[:37]}..."


_BUFFER = MetricsBuffer()


def process_metrics() -> MetricsBuffer:
    return _BUFFER


def log(step: int, **values: float) -> None:
    """Record `values` (loss=..., lr=..., any number or 1-element tensor) at `step` for the dashboard.

    Example: `fsdp2nb.log(step, loss=loss, grad_norm=norm)`; the dashboard plots rank 0's values.
    """
    if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
        raise InvalidValue(f"step={step!r} must be an int")
    _BUFFER.log(int(step), values)
