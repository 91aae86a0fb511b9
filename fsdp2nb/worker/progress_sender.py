"""Turns a rank's `fsdp2nb.progress` updates into `TaskProgress` events, throttled.

A task's first and last updates are always sent; in between at most one every
`min_interval_s` per task, so a save that writes thousands of buffers sends a few events a
second. Updates come from the training thread and from writer threads alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fsdp2nb.wire.events import TaskProgress
from fsdp2nb.wire.records import ProgressUpdate

MIN_INTERVAL_S = 0.25


class ProgressSender:
    """The progress listener a rank installs; `send` puts an event on the events channel."""

    def __init__(self, rank: int, send: Callable[[TaskProgress], None], cell_id: Callable[[], int | None],
                 min_interval_s: float = MIN_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._rank = rank
        self._send = send
        self._cell_id = cell_id
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tasks: dict[int, tuple[int | None, float]] = {}  # task id -> (its cell, last sent)

    def __call__(self, update: ProgressUpdate) -> None:
        cell_id = self._due(update)
        if cell_id is not False:
            self._send(TaskProgress(rank=self._rank, cell_id=cell_id, update=update))

    def _due(self, update: ProgressUpdate) -> int | None | bool:
        """The cell to send the update for, or False when it is too soon after the last one."""
        now = self._clock()
        with self._lock:
            known = self._tasks.get(update.task_id)
            if update.finished:
                self._tasks.pop(update.task_id, None)
                return known[0] if known else self._cell_id()
            if known is not None and now - known[1] < self._min_interval_s:
                return False
            cell_id = known[0] if known else self._cell_id()
            self._tasks[update.task_id] = (cell_id, now)
            return cell_id
