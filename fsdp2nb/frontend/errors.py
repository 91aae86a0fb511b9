"""What the notebook shows when ranks fail: the error a cell raises (`RankError`), a cell that
does not parse, and a rank's death said as an error.

`RankError` (defined in fsdp2nb/errors.py, and importable from here as before) is what user code
catches (`%fsdp2` cells and background runs raise it); IPython draws it through its
`_render_traceback_`, which is `render_rank_error` (registered here, so that errors.py imports
no part of the package): one block per distinct traceback.
"""

from __future__ import annotations

from fsdp2nb.errors import Fsdp2nbError, RankError, set_rank_error_renderer
from fsdp2nb.frontend.memory_notes import shortage_lines, sigkill_line
from fsdp2nb.frontend.output import rank_label
from fsdp2nb.pool.launcher import describe_exit
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.records import ErrorInfo

NOT_RAISED = {"RankDied", "RankStuck", "RankStopped", "BdbQuit", "NothingToDebug", "CollectiveReleased"}
"""What befell a rank rather than an exception it raised: said as a sentence, not as "raised"."""


def render_rank_error(rank_error: RankError) -> list[str]:
    """The lines IPython shows for a RankError: each distinct traceback once, root cause first."""
    lines: list[str] = []
    for ranks, error in rank_error.grouped():
        label = rank_label(ranks, rank_error.world_size) or "[rank 0]"
        noun = "rank" if len(ranks) == 1 else "ranks"
        if error.ename in NOT_RAISED:
            what = f": {error.evalue}"
        else:  # without a traceback the rank's message is the whole story: one line
            what = f" raised {error.ename}" + ("" if error.traceback else f": {error.evalue}")
        lines.append(f"\x1b[1m{label} {noun} {', '.join(map(str, sorted(ranks)))}{what}\x1b[0m")
        lines.extend(error.traceback)
    lines.extend(shortage_lines(rank_error.errors))
    lines.extend(rank_error.notes)
    return lines


set_rank_error_renderer(render_rank_error)


class CellSyntaxError(Fsdp2nbError):
    """A cell that does not parse: reported once, in the notebook, and run on no rank."""

    def __init__(self, error: SyntaxError) -> None:
        super().__init__(f"{error.msg} (line {error.lineno})")
        self.error = error

    def _render_traceback_(self) -> list[str]:
        import traceback

        lines = traceback.format_exception_only(SyntaxError, self.error)
        return [line.rstrip("\n") for line in lines] + ["(the cell ran on no rank)"]


class PoolTakenError(Fsdp2nbError):
    """Another kernel took this kernel's kept pool (`%fsdp2 attach NAME --take`) while a request
    waited for its ranks: their replies go to that kernel now. Shown as one line."""

    def _render_traceback_(self) -> list[str]:
        return [alarm(str(self))]


def alarm(text: str) -> str:
    """`text` in bold red, as IPython shows what went wrong; for notes under a cell's error."""
    return f"\x1b[1;31m{text}\x1b[0m"


def rank_exit_error(event: RankExited) -> ErrorInfo:
    lines = (f"rank {event.rank} (pid {event.pid}) died: {describe_exit(event)}",
             *((killer,) if (killer := sigkill_line(event)) else ()),
             *(("last output lines:", *tail) if (tail := _last_words(event.stderr_tail)) else ()))
    return ErrorInfo(ename="RankDied", evalue=describe_exit(event), traceback=tuple(lines))


def _last_words(tail: tuple[str, ...]) -> tuple[str, ...]:
    """The last 10 lines; for a crash in C code, its Python stack from the top (where it crashed)."""
    crash = next((i for i, line in enumerate(tail) if line.startswith("Fatal Python error")), None)
    if crash is None:
        return tail[-10:]
    stack = [line for line in tail[crash:] if not line.startswith("Extension modules")]
    return tuple(stack[:16])

