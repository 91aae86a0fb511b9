"""Copies from a GPU into host memory, off the training thread: one copier serves async saves
(staging.py) and snapshots in host memory (memory_snapshots.py).

The copy runs on a side stream of the GPU the state lives on, after an event recorded on the
training thread once the step that made the state was queued, so it overlaps the next forward and
backward. A stream made on the copy thread without naming its device would belong to GPU 0 (a
CUDA context there for every rank), and its `synchronize()` would wait on that GPU, not on the copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class QueuedWork:
    """The point on a GPU's stream after which the state to copy is whole."""

    device: int
    """The GPU's index."""
    event: Any
    """A `torch.cuda.Event` recorded on that GPU's current stream."""


def queued_work_of(tensors: Iterable[torch.Tensor]) -> QueuedWork | None:
    """The work queued so far on the current stream of the GPU that `tensors` live on; None where
    none is on a GPU."""
    device = next((tensor.device for tensor in tensors if tensor.is_cuda), None)
    if device is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return QueuedWork(index, torch.cuda.current_stream(index).record_event())


def queued_work_on_current_device() -> QueuedWork | None:
    """The work queued so far on this thread's GPU; None where CUDA is not in use."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    index = torch.cuda.current_device()
    return QueuedWork(index, torch.cuda.current_stream(index).record_event())


@contextlib.contextmanager
def _on_device_stream(device: int, stream: Any) -> Iterator[None]:
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


def _cuda_stream(device: int) -> Any:
    return torch.cuda.Stream(device=device)


class DeviceToHostCopier:
    """Runs copies on a side stream of the GPU that queued the state, one stream per GPU, made once.
    `make_stream` and `on_stream` are CUDA's unless a test injects stand-ins."""

    def __init__(self, make_stream: Callable[[int], Any] = _cuda_stream,
                 on_stream: Callable[[int, Any], contextlib.AbstractContextManager] = _on_device_stream) -> None:
        self._make_stream, self._on_stream = make_stream, on_stream
        self._streams: dict[int, Any] = {}

    def run(self, queued: QueuedWork | None, copy: Callable[[], _T]) -> _T:
        """`copy()` (which queues non-blocking copies) after `queued`, on its GPU's side stream;
        returns once the copies are in host memory. Without `queued` (CPU state), just `copy()`."""
        if queued is None:
            return copy()
        stream = self._streams.get(queued.device)
        if stream is None:
            stream = self._streams[queued.device] = self._make_stream(queued.device)
        with self._on_stream(queued.device, stream):
            stream.wait_event(queued.event)
            result = copy()
        stream.synchronize()
        return result
