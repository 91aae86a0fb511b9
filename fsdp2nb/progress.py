"""Progress of long work (a model load, a checkpoint save or load, an HF export), for whoever listens.

The engine and checkpoint code call `start_task(...)` and then `advance(...)` / `finish()` on the
task it returns. Nobody listens by default: `start_task` then returns a shared task whose methods
do nothing, so code used without a notebook pays one global read per task. A rank of a pool
installs a listener (`install`) that turns updates into events for the notebook. A listener's
failure is logged once and never reaches the code doing the work.

No torch and no notebook code here: both sides may import it. `ProgressUpdate`, the reading a
listener gets, is the wire's record (it travels to the kernel inside `TaskProgress`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

from fsdp2nb.wire.records import ProgressUpdate

logger = logging.getLogger(__name__)


Listener = Callable[[ProgressUpdate], None]
_listener: Listener | None = None
_task_ids = itertools.count(1)
_failed_before = False


def install(listener: Listener | None) -> None:
    """Send every task's updates to `listener` (None: to nobody again)."""
    global _listener
    _listener = listener


def listening() -> bool:
    """Whether anyone listens; callers skip working out totals when nobody does."""
    return _listener is not None


class Task:
    """A running piece of long work; thread-safe (an async save advances from its writer thread)."""

    def __init__(self, listener: Listener, kind: str, label: str, total_bytes: int, total_items: int) -> None:
        self._listener = listener
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.task_id = next(_task_ids)
        self.kind, self.label = kind, label
        self.total_bytes, self.total_items = total_bytes, total_items
        self.done_bytes = self.done_items = 0
        self.finished = False

    def advance(self, num_bytes: int = 0, num_items: int = 0) -> None:
        with self._lock:
            if self.finished:
                return
            self.done_bytes += num_bytes
            self.done_items += num_items
            update = self._update()
        _tell(self._listener, update)

    def set_totals(self, total_bytes: int | None = None, total_items: int | None = None) -> None:
        """Totals learnt once the work is planned (a load's read plan)."""
        with self._lock:
            self.total_bytes = self.total_bytes if total_bytes is None else total_bytes
            self.total_items = self.total_items if total_items is None else total_items

    def finish(self, error: BaseException | str | None = None) -> None:
        """The end, successful or not; later calls do nothing."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
            update = self._update(error=None if error is None else str(error) or type(error).__name__)
        _tell(self._listener, update)

    def _update(self, error: str | None = None) -> ProgressUpdate:
        return ProgressUpdate(task_id=self.task_id, kind=self.kind, label=self.label, done_bytes=self.done_bytes,
                              total_bytes=self.total_bytes, done_items=self.done_items,
                              total_items=self.total_items, elapsed_s=time.monotonic() - self._started,
                              finished=self.finished, error=error)

    def __reduce__(self) -> tuple:
        # Pickled into another process (DCP's writer process) nobody there listens.
        return (_silent, ())


class _SilentTask:
    """What `start_task` returns while nobody listens: every call does nothing."""

    task_id = 0
    finished = False

    def advance(self, num_bytes: int = 0, num_items: int = 0) -> None:
        pass

    def set_totals(self, total_bytes: int | None = None, total_items: int | None = None) -> None:
        pass

    def finish(self, error: BaseException | str | None = None) -> None:
        pass


SILENT = _SilentTask()
AnyTask = Task | _SilentTask


def _silent() -> _SilentTask:
    return SILENT


def start_task(kind: str, label: str, total_bytes: int = 0, total_items: int = 0) -> AnyTask:
    """A task whose updates go to the installed listener; the first update says it started."""
    listener = _listener
    if listener is None:
        return SILENT
    task = Task(listener, kind, label, total_bytes, total_items)
    _tell(listener, task._update())
    return task


def _tell(listener: Listener, update: ProgressUpdate) -> None:
    global _failed_before
    try:
        listener(update)
    except Exception:  # progress is a courtesy: the work it reports on must go on
        if not _failed_before:
            logger.exception("fsdp2nb: a progress listener failed (later failures are not logged)")
        _failed_before = True
