"""Save requests posted from the notebook, consumed at a safe point of the training loop.

The rank's control thread posts a request while the main thread trains; `Checkpointer.maybe_save`
reads the highest posted id and makes every rank agree on it collectively. Ids (rather than a flag)
let a request that reaches one rank late be recognised as one that was already served.

The record also keeps what became of the newest served request (the step it saves, whether that
save committed or failed), which the dashboard follows: LATEST alone cannot tell, since a
notebook run again into the same directory saves a step that LATEST named already.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from fsdp2nb.errors import InvalidValue


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What became of the save requests, read at once (the dashboard's sampler sends it)."""

    served: int
    """The highest request id served (a save was started for it, or it failed)."""
    step: int | None
    """The step the save serving `served` saves."""
    committed: int
    """The highest request id whose save was committed."""
    error: str | None
    """Why the save serving `served` failed, or None."""


class SaveRequests:
    """Thread-safe record of the highest save request id posted, the highest one served, and the
    outcome of the newest served one."""

    __slots__ = ("_lock", "_posted", "_served", "_step", "_committed", "_error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted = 0
        self._served = 0
        self._step: int | None = None
        self._committed = 0
        self._error: str | None = None

    def post(self, request_id: int | None = None) -> int:
        """Ask for a save; `request_id` (>= 1) should be the same on every rank for the same request."""
        with self._lock:
            if request_id is None:
                request_id = max(self._posted, self._served) + 1
            if isinstance(request_id, bool) or not isinstance(request_id, int) or request_id < 1:
                raise InvalidValue(f"request_id={request_id!r} must be an int >= 1")
            self._posted = max(self._posted, request_id)
            return request_id

    def pending(self) -> int:
        """The highest posted id not yet served, or 0 when nothing is waiting."""
        with self._lock:
            return self._posted if self._posted > self._served else 0

    def mark_served(self, request_id: int, step: int | None = None) -> None:
        """Record that every request up to `request_id` is served (agreed across ranks), by a save
        of `step` that starts now."""
        with self._lock:
            if request_id > self._served:
                self._served, self._step, self._error = request_id, step, None

    def mark_committed(self, request_id: int) -> None:
        """The save that served `request_id` is committed."""
        with self._lock:
            self._committed = max(self._committed, request_id)

    def mark_failed(self, request_id: int, error: str) -> None:
        """The save that served `request_id` failed."""
        with self._lock:
            if request_id == self._served and self._committed < request_id:
                self._error = error

    def served(self) -> int:
        """The highest id served so far."""
        with self._lock:
            return self._served

    def outcome(self) -> RequestOutcome:
        with self._lock:
            return RequestOutcome(served=self._served, step=self._step, committed=self._committed, error=self._error)


_PROCESS_REQUESTS = SaveRequests()


def process_requests() -> SaveRequests:
    """The request record shared by this process's control thread and its checkpointers."""
    return _PROCESS_REQUESTS


def post_save_request(request_id: int | None = None) -> int:
    """Ask the tracked checkpointer to save at its next `maybe_save`; safe from any thread."""
    return _PROCESS_REQUESTS.post(request_id)


class FailureNotices:
    """Background saves that failed and that no cell has said so yet: the save thread posts one,
    the rank prints it at the end of the next cell, and a cell that raised the failure already
    (`save`, `wait`) drops it. Thread-safe."""

    __slots__ = ("_lock", "_text")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text: str | None = None

    def post(self, text: str) -> None:
        with self._lock:
            self._text = text

    def take(self) -> str | None:
        """The notice not yet said, once; None when there is none."""
        with self._lock:
            text, self._text = self._text, None
            return text


_PROCESS_FAILURES = FailureNotices()


def process_failures() -> FailureNotices:
    """The failed background saves of this process's checkpointers that no cell has said yet."""
    return _PROCESS_FAILURES


class StopRequests:
    """A stop asked for from the notebook (the dashboard's Stop, the stop button) that a training
    loop honours at its next step instead of a KeyboardInterrupt; only while a loop listens."""

    __slots__ = ("_lock", "_listeners", "_posted")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners = 0
        self._posted = False

    def listen(self) -> None:
        with self._lock:
            self._listeners += 1
            self._posted = False

    def unlisten(self) -> None:
        with self._lock:
            self._listeners = max(0, self._listeners - 1)
            self._posted = False

    def post(self) -> bool:
        """Ask for a stop; False when no loop listens (the caller interrupts instead) or a stop
        was already asked for (a second press: the loop did not stop, so interrupt it)."""
        with self._lock:
            if not self._listeners or self._posted:
                return False
            self._posted = True
            return True

    def pending(self) -> bool:
        with self._lock:
            return self._posted


_PROCESS_STOPS = StopRequests()


def process_stops() -> StopRequests:
    """The stop record shared by this process's control thread and its training loop."""
    return _PROCESS_STOPS
