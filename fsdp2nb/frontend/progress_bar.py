"""The running cell's progress bar for long work on the ranks (a model load, a save, a load, an export).

One bar per cell, showing its newest task summed over the ranks. In a kernel it is an HTML
widget whose display also carries a text form (nbclient and nbconvert show that), rewritten
when a task starts and ends: a few lines, whatever the number of updates. In terminal
IPython it prints a line when a task starts, every PRINT_EVERY_S and when it ends.
Only the main thread shows anything: a cell run for a dashboard button is followed by the
dashboard itself. The bars of the last `MAX_LIVE_BARS` cells stay widgets; an older one is
turned into its text form and its widgets are closed, so a day of saves keeps no widget per cell.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from typing import Any

from fsdp2nb.widgets.model import TaskBoard
from fsdp2nb.wire.events import TaskProgress
from fsdp2nb.wire.records import ProgressUpdate

MIN_REDRAW_S = 0.25
PRINT_EVERY_S = 10.0
MAX_LIVE_BARS = 20
"""Bars kept as widgets. Each holds three widgets (the HTML, its layout and style) and their comms
in the kernel for as long as it lives; a cell that saves every time would otherwise add three
for good, thousands in a long session."""


class CellTaskBar:
    """Fed the cell's TaskProgress events by the thread that waits for the cell."""

    def __init__(self, world_size: int, clock=time.monotonic) -> None:  # a clock
        self._world_size = world_size
        self._clock = clock
        self._board = TaskBoard()
        self._enabled = threading.current_thread() is threading.main_thread()
        self._widget: Any = None  # an ipywidgets.HTML, made on first use
        self._display_id = f"fsdp2nb-progress-{uuid.uuid4().hex}"
        self._finished_lines: list[str] = []
        self._text = ""  # the text form last published: what the bar becomes when retired
        self._shown: tuple[str, str, bool] | None = None  # (kind, label, finished) of the text shown
        self._drawn_at = float("-inf")
        self._printed_at = float("-inf")

    def update(self, event: TaskProgress) -> None:
        self._board.observe(event)
        task = self._board.latest(self._world_size)
        if not self._enabled or task is None:
            return
        if _in_kernel():
            self._show_in_kernel(task)
        else:
            self._print(task)

    def close(self) -> None:
        """At the cell's end: a task still running (an async save) goes on; the dashboard follows it."""
        task = self._board.latest(self._world_size)
        if not self._enabled or task is None or task.finished:
            return
        note = "continues after the cell: the dashboard follows it"
        if _in_kernel():
            self._show_in_kernel(task, note, force=True)
        else:
            print(f"{_text(task)} ({note})")

    def _show_in_kernel(self, task: ProgressUpdate, note: str = "", force: bool = False) -> None:
        from fsdp2nb.widgets.markup import task_html

        now = self._clock()
        if self._widget is None:
            import ipywidgets

            self._widget = ipywidgets.HTML(task_html(task))  # made on the main thread (see __init__)
            self._publish(task, "display_data")
            _LIVE_BARS.keep(self)
        elif force or task.finished or now - self._drawn_at >= MIN_REDRAW_S:
            self._widget.value = task_html(task)
        else:
            return
        self._drawn_at = now
        key = (task.kind, task.label, task.finished)
        if key != self._shown or note:  # the text form changes when a task starts or ends
            self._publish(task, "update_display_data", note)

    def _publish(self, task: ProgressUpdate, msg_type: str, note: str = "") -> None:
        lines = self._finished_lines + [_text(task) + (f" ({note})" if note else "")]
        if task.finished and self._shown != (task.kind, task.label, True):
            self._finished_lines.append(_text(task))
        self._shown = (task.kind, task.label, task.finished)
        self._text = "\n".join(lines)
        data = {"text/plain": self._text, "application/vnd.jupyter.widget-view+json": {
            "version_major": 2, "version_minor": 0, "model_id": self._widget.model_id}}
        self._send(data, update=msg_type == "update_display_data")

    def retire(self) -> None:
        """Show the bar's text form where it was drawn, and close its widgets."""
        if self._widget is None:
            return
        self._send({"text/plain": self._text}, update=True)
        for widget in (self._widget, self._widget.layout, self._widget.style):
            widget.close()
        self._widget = None

    def _send(self, data: dict, update: bool) -> None:
        from IPython.core.getipython import get_ipython

        shell = get_ipython()
        assert shell is not None, "shown in a kernel only (_in_kernel)"
        shell.display_pub.publish(data=data, metadata={}, transient={"display_id": self._display_id}, update=update)

    def _print(self, task: ProgressUpdate) -> None:
        now = self._clock()
        key = (task.kind, task.label, task.finished)
        if key != self._shown or now - self._printed_at >= PRINT_EVERY_S:
            self._shown, self._printed_at = key, now
            print(_text(task))


class _LiveBars:
    """The bars still drawn as widgets, oldest first; used on the main thread only (bars are)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._bars: deque[CellTaskBar] = deque()

    def keep(self, bar: CellTaskBar) -> None:
        self._bars.append(bar)
        while len(self._bars) > self.limit:
            self._bars.popleft().retire()


_LIVE_BARS = _LiveBars(MAX_LIVE_BARS)
"""The kernel's one list: a bar outlives its cell (its display stays in the notebook)."""


def _text(task: ProgressUpdate) -> str:
    from fsdp2nb.widgets.markup import task_text

    return task_text(task)


def _in_kernel() -> bool:
    from IPython.core.getipython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None
