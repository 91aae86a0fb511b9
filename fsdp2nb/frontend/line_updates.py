"""Lines that ranks update in place with a carriage return (tqdm, Trainer's progress bar).

A rank that writes `\\r 10%|█ | 1/10` and then `\\r 20%|██ | 2/10` means one line that changes. In
the notebook such a line becomes one display per rank, labelled at its start like other output
(`[1]  20%|██ | 2/10`), shown once the line has been open for `SHOW_AFTER_S`, updated in place
(at most every `MIN_UPDATE_INTERVAL_S`) while it is open and left showing its final state once the
rank ends the line. A line that ends before it was ever shown is written as plain text, reduced to
what a terminal would show of it, so a short bar costs one line and no display.
Where the front end cannot update a display (terminal IPython) nothing is shown until the line
ends: the output reads as clean lines there too.

`StreamMerger` (render.py) holds lines; it asks this module what a line shows and hands it the
lines that stay open.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

MIN_UPDATE_INTERVAL_S = 0.2
"""At most five updates a second per line: tqdm redraws up to ten times a second on every rank."""

SHOW_AFTER_S = 0.05
"""A line gets its display once it has been open this long (at its second drawing, for tqdm or
a stream redrawn ten times a second): a bar that ends sooner is one line of text and no display,
and text streamed for a quarter of a second is seen to grow."""


def has_carriage_return(text: str) -> bool:
    return "\r" in text


def visible(line: str) -> str:
    """What a terminal shows of `line`: each piece after a `\\r` overwrites from the first column."""
    if "\r" not in line:
        return line
    shown = ""
    for piece in line.split("\r"):
        shown = piece + shown[len(piece):]
    return shown.rstrip(" ")


def collapsed(partial: str) -> str:
    """An open line reduced to its latest state, still marked as one updated in place; so a bar
    of 10,000 steps is held (and counted against the rank's output limit) as one state."""
    return "\r" + visible(partial) if "\r" in partial else partial


class Handle(Protocol):
    def update(self, obj: Any, *, raw: bool = ...) -> None: ...


ShowLine = Callable[[str], Handle]
"""Shows a new line (text/plain) and returns a handle that updates it in place."""


def notebook_can_update() -> bool:
    """Whether output can be updated in place: a Jupyter kernel can, terminal IPython cannot."""
    from IPython.core.getipython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


def show_in_notebook(text: str) -> Handle:
    from IPython.display import display

    return display({"text/plain": text}, raw=True, display_id=True)


class LiveLines:
    """The open lines of one cell's ranks, keyed by (rank, stream)."""

    def __init__(self, label: Callable[[int], str], before_show: Callable[[], None],
                 show: ShowLine = show_in_notebook, can_update: Callable[[], bool] = notebook_can_update,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._label = label
        self._before_show = before_show
        self._show = show
        self._can_update = can_update
        self._clock = clock
        self._lines: dict[tuple[int, str], tuple[Handle, str, float]] = {}  # handle, text shown, when
        self._supported: bool | None = None

    def hold(self, rank: int, stream: str, partial: str) -> bool:
        """Show (or update) an open line of `rank`; False when it is no line updated in place and
        should be released as text. Where nothing can be updated, the line is held until it ends."""
        if not has_carriage_return(partial):
            return False
        if self._supported is None:
            self._supported = self._can_update()
        if not self._supported:
            return True
        text = self._labelled(rank, visible(partial))
        key = (rank, stream)
        known = self._lines.get(key)
        if known is None:
            self._before_show()  # the text the ranks printed before the line comes first
            self._lines[key] = (self._show(text), text, self._clock())
        elif known[1] != text and self._clock() - known[2] >= MIN_UPDATE_INTERVAL_S:
            known[0].update({"text/plain": text}, raw=True)
            self._lines[key] = (known[0], text, self._clock())
        return True

    def end(self, rank: int, stream: str, line: str) -> str | None:
        """`rank` ended a line: its final state goes into the line's display (None returned), or,
        if it was never shown, is returned as the text to write."""
        known = self._lines.pop((rank, stream), None)
        if known is None:
            return visible(line)
        text = self._labelled(rank, visible(line))
        if text != known[1]:
            known[0].update({"text/plain": text}, raw=True)
        return None

    def _labelled(self, rank: int, text: str) -> str:
        label = self._label(rank)
        return f"{label} {text}" if label else text


def counted_chars(text: str) -> int:
    """Characters of `text` that count against a rank's output limit: of a line redrawn with
    `\\r` only what it shows, so a long progress bar does not use up the rank's output."""
    if "\r" not in text:
        return len(text)
    return sum(len(visible(line)) for line in text.split("\n")) + text.count("\n")
