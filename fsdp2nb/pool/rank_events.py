"""What the ranks send the kernel, sorted as it arrives by the thread that reads it
(pool/event_reader.py: a request's waiting thread, else the pool's receiving thread).

Events never wait unread: snapshots keep flowing and a rank's output never backs up while the
notebook is idle. Snapshots and progress go to the listeners (the dashboard) and `snapshots`;
joins and exits to `ranks` and `exited`; what ranks' own threads print between cells is held,
bounded, for the next cell; a request's events queue for the thread that waits on it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from fsdp2nb.pool.handle import SnapshotListener
from fsdp2nb.pool.held_output import HeldOutput
from fsdp2nb.wire.events import (
    EventMessage,
    RankClock,
    RankExited,
    RankProfile,
    RankReady,
    RankSnapshot,
    RankStacks,
    RendezvousOpened,
    RichOutput,
    StreamOutput,
    TaskProgress,
)

logger = logging.getLogger(__name__)


class RankEvents:
    """The records kept of a pool's ranks as their events are read, and the queue of request events."""

    def __init__(self, ranks_to_join: int, on_exit: Callable[[RankExited], None]) -> None:
        """`on_exit` is called (on the reading thread) when a rank's agent reports its end."""
        self.ranks: dict[int, RankReady] = {}
        self.snapshots: dict[int, RankSnapshot] = {}
        self.exited: dict[int, RankExited] = {}
        self.held_output = HeldOutput()
        self.listeners: list[SnapshotListener] = []
        """Called on the reading thread with every snapshot and every progress event."""
        self.ranks_to_join = ranks_to_join
        """How many RankReady make the pool ready: fewer when attaching a kept pool a rank of
        which died while no kernel held it."""
        self.all_joined = threading.Event()
        self._rendezvous: RendezvousOpened | None = None
        self._queue: queue.SimpleQueue[EventMessage] = queue.SimpleQueue()  # C: far cheaper than Queue
        self._on_exit = on_exit

    def take_rendezvous(self) -> RendezvousOpened | None:
        """Rank 0's store address, once, when it has said so (pools across hosts)."""
        opened, self._rendezvous = self._rendezvous, None
        return opened

    def next_event(self, timeout_s: float) -> EventMessage | None:
        """The next event for a waiting request, in arrival order, as another thread sorts it;
        None after `timeout_s`."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def take_nowait(self) -> EventMessage | None:
        """The next event already sorted for a waiting request, if there is one."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def sort(self, event: EventMessage) -> None:
        """Put `event` where it belongs; one bad event or listener must not silence every rank."""
        try:
            self._sort(event)
        except Exception:
            logger.exception("fsdp2nb: failed to handle an event from the ranks")

    def _sort(self, event: EventMessage) -> None:
        if isinstance(event, (RankSnapshot, TaskProgress)):
            if isinstance(event, RankSnapshot):
                self.snapshots[event.rank] = event
            for listener in list(self.listeners):
                listener(event)
            if isinstance(event, RankSnapshot) or event.cell_id is None:
                return  # a progress event of a cell also goes to the cell, for its own bar
        if isinstance(event, (RankProfile, RankStacks, RankClock)):  # whenever they come: for frontend/profiles.py
            for listener in list(self.listeners):
                listener(event)
            return
        if isinstance(event, RendezvousOpened):
            self._rendezvous = event
            return
        if isinstance(event, RankReady):
            self.ranks[event.rank] = event
            if len(self.ranks) >= self.ranks_to_join:
                self.all_joined.set()
            return
        if isinstance(event, RankExited):
            self.exited[event.rank] = event
            self._on_exit(event)
        if isinstance(event, (StreamOutput, RichOutput)) and event.cell_id is None:
            self.held_output.add(event)  # a rank's own thread, between cells
            return
        self._queue.put(event)
