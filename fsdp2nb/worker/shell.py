"""The IPython shell each rank runs cells in, with display and tracebacks sent to the notebook.

Using a real InteractiveShell means a cell behaves as in a notebook: magics and `!` work, the
last expression is displayed, `display()` publishes rich output, and tracebacks are IPython's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from fsdp2nb.pool.protocol import ErrorInfo, RichKind

RichSink = Callable[[RichKind, dict, dict], None]


def _discard(kind: RichKind, data: dict, metadata: dict) -> None:
    pass


class _RankDisplayHook(DisplayHook):
    """Sends the cell's last expression as an execute result instead of printing `Out[n]:`."""

    sink: RichSink = staticmethod(_discard)

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict, md_dict=None) -> None:
        self.sink("result", format_dict, md_dict or {})

    def finish_displayhook(self) -> None:
        pass


class _RankDisplayPublisher(DisplayPublisher):
    """Sends `display()` and `clear_output()` to the notebook."""

    sink: RichSink = staticmethod(_discard)

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs) -> None:
        self.sink("display", data, metadata or {})

    def clear_output(self, wait: bool = False) -> None:
        self.sink("clear", {"wait": wait}, {})


class RankShell(InteractiveShell):
    """An InteractiveShell that records the last exception instead of printing it."""

    last_error: ErrorInfo | None = None

    def _showtraceback(self, etype, evalue, stb: list[str]) -> None:
        self.last_error = ErrorInfo(
            ename=getattr(etype, "__name__", str(etype)), evalue=str(evalue), traceback=tuple(stb)
        )


def make_shell(namespace: dict, sink: RichSink) -> RankShell:
    """A shell whose user namespace starts with `namespace` and whose displays go to `sink`."""
    config = Config()
    # N ranks writing one SQLite history file would contend on its lock for nothing.
    config.HistoryManager.enabled = False
    # instance(): display() and get_ipython() find only the registered singleton.
    shell = RankShell.instance(
        config=config, user_ns=namespace, displayhook_class=_RankDisplayHook,
        display_pub_class=_RankDisplayPublisher, colors="linux",
    )
    shell.displayhook.sink = sink
    shell.display_pub.sink = sink
    shell.events.register("post_run_cell", _flush_matplotlib_figures)
    return shell


def run_cell(shell: RankShell, code: str, transformed: str | None = None,
             execution_count: int | None = None) -> ErrorInfo | None:
    """Run one cell; the error it raised, if any.

    `transformed` is the cell after IPython's input transformations, done once in the notebook
    kernel for all ranks. With it, the rank skips re-transforming (and IPython's per-cell output
    tee) and drives IPython's own `run_cell_async` directly, which keeps an empty cell cheap.
    Cells with top-level `await` take IPython's full path.

    The notebook keeps the history: ranks number their cells with the notebook's count (so a
    traceback's `In[N]` is the notebook cell's) and skip IPython's history bookkeeping, a third
    of the cost of an empty cell. `_` still holds the last result.
    """
    shell.last_error = None
    if execution_count is not None:
        shell.execution_count = execution_count
    if transformed is None or shell.should_run_async(code, transformed_cell=transformed,
                                                     preprocessing_exc_tuple=None):
        result = shell.run_cell(code, store_history=False)
    else:
        result = None
        try:
            result = _run_synchronously(shell.run_cell_async(code, store_history=False,
                                                             transformed_cell=transformed))
        finally:
            shell.events.trigger("post_execute")
            shell.events.trigger("post_run_cell", result)
    if result.success:
        return None
    return shell.last_error or ErrorInfo(ename="Error", evalue="the cell failed", traceback=())


def _run_synchronously(coroutine):
    """Run a coroutine that never suspends (should_run_async said so) to its result."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a cell that should not await suspended")


def _flush_matplotlib_figures(result=None) -> None:
    """Show figures a cell drew but did not show, as the inline backend does in a notebook."""
    if "matplotlib.pyplot" not in sys.modules:
        return
    try:
        from matplotlib_inline.backend_inline import flush_figures
    except ImportError:
        return
    flush_figures()
