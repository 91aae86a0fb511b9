"""Which ranks run a request from this kernel, and since when: marked by cells, background
runners and the dashboard's threads at once, read by anyone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BusyRanks:
    """The ranks running a request (a cell, a background run) and when each started it. Each
    change replaces the record whole, under a lock, so a reader never takes a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ranks: frozenset[int] = frozenset()
        self.since: dict[int, float] = {}
        """Rank -> when it started what it runs now (time.time()), for the dashboard's clocks."""
        self.listeners: list[Callable[[], None]] = []
        """Called after each change, on the thread that made it (the dashboard's wake-up)."""

    def mark(self, ranks: tuple[int, ...], since: dict[int, float] | None = None) -> None:
        """`since`: when ranks started a request sent before (a kept pool's run, on attach); else now."""
        now = time.time()
        with self._lock:
            self.ranks = self.ranks | frozenset(ranks)
            self.since = {**self.since, **{rank: (since or {}).get(rank, now) for rank in ranks}}
        self._changed()

    def clear(self, ranks: tuple[int, ...]) -> None:
        with self._lock:
            self.ranks = self.ranks - frozenset(ranks)
            self.since = {rank: at for rank, at in self.since.items() if rank not in ranks}
        self._changed()

    def _changed(self) -> None:
        for listener in list(self.listeners):
            listener()
