"""What the notebook shows when ranks fail: the error a cell raises (`RankError`), a cell that
does not parse, and a rank's death said as an error.

`RankError` is what user code catches (`%fsdp2` cells and `run_background` raise it); IPython
draws it through `_render_traceback_`, one block per distinct traceback.
"""

from __future__ import annotations

from fsdp2nb.frontend.memory_notes import shortage_lines, sigkill_line
from fsdp2nb.frontend.output import rank_label
from fsdp2nb.pool.launcher import describe_exit
from fsdp2nb.wire.protocol import ErrorInfo, RankExited

NOT_RAISED = {"RankDied", "RankStuck", "RankStopped", "BdbQuit", "NothingToDebug"}
"""What befell a rank rather than an exception it raised: said as a sentence, not as "raised"."""


class RankError(Exception):
    """One or more ranks raised; IPython shows each distinct traceback once, root cause first."""

    def __init__(self, errors: list[tuple[int, ErrorInfo]], world_size: int, notes: tuple[str, ...] = ()) -> None:
        self.errors = errors
        self.world_size = world_size
        self.notes = notes
        first_rank, first = errors[0]
        super().__init__(f"rank {first_rank} raised {first.ename}: {first.evalue}")

    def grouped(self) -> list[tuple[list[int], ErrorInfo]]:
        """Distinct tracebacks in the order they were first reported, with the ranks that raised each."""
        groups: dict[tuple, tuple[list[int], ErrorInfo]] = {}
        for rank, error in self.errors:
            key = (error.ename, error.evalue, _without_cell_numbers(error.traceback))
            groups.setdefault(key, ([], error))[0].append(rank)
        return list(groups.values())

    def _render_traceback_(self) -> list[str]:
        lines: list[str] = []
        for ranks, error in self.grouped():
            label = rank_label(ranks, self.world_size) or "[rank 0]"
            noun = "rank" if len(ranks) == 1 else "ranks"
            if error.ename in NOT_RAISED:
                what = f": {error.evalue}"
            else:  # without a traceback the rank's message is the whole story: one line
                what = f" raised {error.ename}" + ("" if error.traceback else f": {error.evalue}")
            lines.append(f"\x1b[1m{label} {noun} {', '.join(map(str, sorted(ranks)))}{what}\x1b[0m")
            lines.extend(error.traceback)
        lines.extend(shortage_lines(self.errors))
        lines.extend(self.notes)
        return lines


class CellSyntaxError(Exception):
    """A cell that does not parse: reported once, in the notebook, and run on no rank."""

    def __init__(self, error: SyntaxError) -> None:
        super().__init__(f"{error.msg} (line {error.lineno})")
        self.error = error

    def _render_traceback_(self) -> list[str]:
        import traceback

        lines = traceback.format_exception_only(SyntaxError, self.error)
        return [line.rstrip("\n") for line in lines] + ["(the cell ran on no rank)"]


class PoolTakenError(Exception):
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


def _without_cell_numbers(traceback_lines: tuple[str, ...]) -> tuple[str, ...]:
    # Ranks number their cells alike, but a rank that joined later would differ: ignore `In[n]`.
    import re

    return tuple(re.sub(r"In\[\d+\]", "In[]", line) for line in traceback_lines)
