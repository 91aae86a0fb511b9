"""What ranks' own threads print or display between cells, held (bounded) for the next cell.

The thread reading the pool's events adds to it; the session takes it all at the start of a cell.
"""

from __future__ import annotations

import dataclasses
import threading

from fsdp2nb.wire.events import RichOutput, StreamOutput

HELD_CHARS_PER_RANK = 100_000
"""Text a rank's own threads print between cells, kept for the next cell (the newest part)."""
HELD_DISPLAYS_PER_RANK = 10
"""Displays (figures, tables) likewise, counted whole: one figure can outweigh the text limit."""


class HeldOutput:
    """What ranks' own threads printed or displayed between cells, held for the next cell to show.

    Nothing shows it until then, so only the newest `max_chars` of text and `max_displays`
    displays per rank are kept: a thread left printing overnight must not grow the kernel
    without bound."""

    def __init__(self, max_chars: int = HELD_CHARS_PER_RANK, max_displays: int = HELD_DISPLAYS_PER_RANK) -> None:
        self._max_chars = max_chars
        self._max_displays = max_displays
        self._lock = threading.Lock()
        self._pieces: list[StreamOutput | RichOutput] = []
        self._chars: dict[int, int] = {}
        self._displays: dict[int, int] = {}
        self.dropped_chars: dict[int, int] = {}
        self.dropped_displays: dict[int, int] = {}

    def add(self, event: StreamOutput | RichOutput) -> None:
        with self._lock:
            self._pieces.append(event)
            if isinstance(event, RichOutput):
                self._displays[event.rank] = self._displays.get(event.rank, 0) + 1
                if self._displays[event.rank] > self._max_displays:
                    self._drop_oldest_display(event.rank)
                return
            self._chars[event.rank] = self._chars.get(event.rank, 0) + len(event.text)
            while self._chars[event.rank] > self._max_chars:
                self._cut_oldest_text(event.rank)

    def _cut_oldest_text(self, rank: int) -> None:
        """Drop the rank's oldest text, or only its start where that is enough."""
        index, piece = next((i, p) for i, p in enumerate(self._pieces)
                            if p.rank == rank and isinstance(p, StreamOutput))
        cut = min(len(piece.text), self._chars[rank] - self._max_chars)
        if cut == len(piece.text):
            del self._pieces[index]
        else:
            self._pieces[index] = dataclasses.replace(piece, text=piece.text[cut:])
        self._chars[rank] -= cut
        self.dropped_chars[rank] = self.dropped_chars.get(rank, 0) + cut

    def _drop_oldest_display(self, rank: int) -> None:
        index = next(i for i, p in enumerate(self._pieces) if p.rank == rank and isinstance(p, RichOutput))
        del self._pieces[index]
        self._displays[rank] -= 1
        self.dropped_displays[rank] = self.dropped_displays.get(rank, 0) + 1

    def __bool__(self) -> bool:
        """Whether anything is held or was dropped: read without the lock, twice per cell."""
        return bool(self._pieces or self.dropped_chars or self.dropped_displays)

    def take(self) -> tuple[list[StreamOutput | RichOutput], dict[int, int], dict[int, int]]:
        """The held pieces in arrival order, and per rank how many characters and displays were dropped."""
        with self._lock:
            taken = self._pieces, self.dropped_chars, self.dropped_displays
            self._pieces, self._chars, self._displays = [], {}, {}
            self.dropped_chars, self.dropped_displays = {}, {}
        return taken
