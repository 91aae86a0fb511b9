"""Who reads the ranks' events: the thread waiting for them, else the pool's receiving thread.

A request's wait (frontend/request_wait.py) reads the connections itself while it waits in
`next_event`, so a rank's reply wakes the thread that acts on it. Read by the receiving thread,
the reply would wake that thread, which would then wake the waiting one: a second hand-over of
the GIL and the CPU for every event, which on a host with few cores costs as much as the first.
While no thread has waited for `STEP_ASIDE_S` (between cells, or while the waiting thread shows
a prompt), the receiving thread reads, so snapshots and output never sit unread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from fsdp2nb.host.sigint import sigint_deferred
from fsdp2nb.pool.rank_events import RankEvents
from fsdp2nb.wire.channels import KernelChannels
from fsdp2nb.wire.events import EventMessage

logger = logging.getLogger(__name__)

RECEIVE_POLL_MS = 100
"""How long the receiving thread's poll lasts before it looks whether to stop."""
STEP_ASIDE_S = 0.05
"""How long after a waiting thread last read the receiving thread leaves the reading to it: a
cell's wait calls `next_event` again within microseconds, and cells run one after another
leave only a few milliseconds between their waits."""


class EventReader:
    """Reads one pool's connections and sorts what arrives into `events`; owns the receiving thread."""

    def __init__(self, channels: KernelChannels, events: RankEvents) -> None:
        self._channels = channels
        self._events = events
        self._turn = threading.Lock()
        """Held by the thread reading the connections: one at a time, so frames stay in order."""
        self._waiting: set[int] = set()
        """The threads inside `next_event` (set.add and discard are atomic under the GIL)."""
        self._last_waited_at = float("-inf")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, daemon=True, name="fsdp2nb-receiver")
        self._thread.start()

    def next_event(self, timeout_s: float) -> EventMessage | None:
        """The next event for the waiting request, in arrival order, read on this thread; None
        after `timeout_s`."""
        event = self._events.take_nowait()
        if event is not None:
            return event
        if self._channels.closed:
            return self._events.next_event(timeout_s)
        deadline = time.monotonic() + timeout_s
        me = threading.get_ident()
        self._waiting.add(me)
        try:
            with self._reading_turn(), sigint_deferred():  # a frame is never dropped half-sorted
                while event is None and (remaining_s := deadline - time.monotonic()) > 0:
                    self._channels.receive(max(1, round(remaining_s * 1000)), self._events.sort)
                    event = self._events.take_nowait()
                    if self._channels.closed:
                        break
        finally:
            self._waiting.discard(me)
            self._last_waited_at = time.monotonic()
        return event

    @contextlib.contextmanager
    def _reading_turn(self):
        if not self._turn.acquire(blocking=False):
            self._channels.wake_reader()  # the receiving thread leaves its poll and steps aside
            self._turn.acquire()
        try:
            yield
        finally:
            self._turn.release()

    def _receive_loop(self) -> None:
        while not self._stopped.is_set():
            aside_s = self._step_aside_s()
            if aside_s > 0 or not self._turn.acquire(blocking=False):
                self._stopped.wait(aside_s or STEP_ASIDE_S)
                continue
            try:
                self._channels.receive(RECEIVE_POLL_MS, self._events.sort)
            except Exception:  # nothing known raises here (bad frames are dropped, handlers guarded):
                logger.exception("fsdp2nb: failed to read an event from the ranks")  # keep serving
            finally:
                self._turn.release()

    def _step_aside_s(self) -> float:
        """How long the receiving thread should leave the reading to a waiting thread; 0: read."""
        if self._waiting:
            return STEP_ASIDE_S
        return max(0.0, self._last_waited_at + STEP_ASIDE_S - time.monotonic())

    def stop(self) -> None:
        """End the receiving thread (not while it reads); safe to call twice, from any thread."""
        self._stopped.set()
        self._channels.wake_reader()
        if self._thread is not threading.current_thread():
            self._thread.join()
