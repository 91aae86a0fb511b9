"""How rank output looks in the notebook: labelled lines, repeated lines shown once,
displays, last-expression values and what ranks printed between cells.

Lines are held back for a short window so that a line every rank prints (a loss, a banner) can
be shown once as `[all]` instead of N times. Lines that differ are shown per rank, grouped by
text, so eight ranks printing two distinct values give two lines, not eight. The session decides
when to show what; this module decides how it looks.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdp2nb.frontend.line_updates import SHOW_AFTER_S, LiveLines, collapsed, counted_chars
from fsdp2nb.wire.events import RankActivity, RichOutput, StreamOutput

if TYPE_CHECKING:
    from fsdp2nb.pool.handle import PoolHandle

MERGE_WINDOW_S = 0.5
PARTIAL_LINE_WINDOW_S = 0.5
MAX_CHARS_PER_RANK = 200_000

Write = Callable[[str, str], None]  # (stream name, text)


def rank_label(ranks: Iterable[int], world_size: int) -> str:
    """`[all]`, `[3]`, `[0,2]` or `[0-3,6]`; empty when the pool has a single rank."""
    ranks = sorted(ranks)
    if world_size == 1:
        return ""
    if len(ranks) == world_size:
        return "[all]"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "[" + ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs) + "]"


@dataclass
class _RankStream:
    partial: str = ""
    partial_since: float = 0.0
    lines: deque = field(default_factory=deque)  # (line with its newline, arrival time)
    shown_chars: int = 0
    truncated: bool = False
    done: bool = False


class StreamMerger:
    """Buffers each rank's stdout/stderr into lines and writes them, merged across ranks."""

    def __init__(self, ranks: tuple[int, ...], world_size: int, write: Write,
                 log_paths: dict[int, str] | None = None, max_chars_per_rank: int = MAX_CHARS_PER_RANK,
                 live_lines: Callable[..., LiveLines] = LiveLines) -> None:
        self._ranks = ranks
        self._world_size = world_size
        self._write = write
        self._log_paths = log_paths or {}
        self._max_chars = max_chars_per_rank
        self._streams = {name: {r: _RankStream() for r in ranks} for name in ("stdout", "stderr")}
        self._holding = False
        """Whether any text may be held back; most cells print nothing, and skip all the rest."""
        self._live = live_lines(lambda rank: rank_label([rank], world_size), before_show=self._write_held_lines)
        """Lines redrawn with `\\r` (progress bars): a display per rank, updated in place."""

    def feed(self, rank: int, stream: str, text: str, now: float | None = None) -> None:
        state = self._streams[stream].get(rank)
        if state is None or state.truncated:
            return
        now = time.monotonic() if now is None else now
        chars = counted_chars(text)
        if state.shown_chars + chars > self._max_chars:
            text = text[: max(0, self._max_chars - state.shown_chars)]
            self._truncate(rank, stream, state, text, now)
            return
        state.shown_chars += chars
        self._holding = True
        self._split_lines(rank, stream, state, text, now)

    def _split_lines(self, rank: int, stream: str, state: _RankStream, text: str, now: float) -> None:
        pieces = (state.partial + text).split("\n")
        if len(pieces) > 1 and not state.partial:
            state.partial_since = now
        for line in pieces[:-1]:
            left = self._live.end(rank, stream, line)  # None: it ended in its display
            if left is not None:
                state.lines.append((left + "\n", now))
        if pieces[-1] and (len(pieces) > 1 or not state.partial):
            state.partial_since = now
        state.partial = collapsed(pieces[-1])

    def _truncate(self, rank: int, stream: str, state: _RankStream, text: str, now: float) -> None:
        self._holding = True
        self._split_lines(rank, stream, state, text, now)
        if state.partial:
            state.lines.append(((self._live.end(rank, stream, state.partial) or "") + "\n", now))
            state.partial = ""
        where = self._log_paths.get(rank, "the rank's log file")
        state.lines.append((f"... output truncated after {self._max_chars:,} characters; "
                            f"the full output is in {where}\n", now))
        state.truncated = True

    def rank_done(self, rank: int) -> None:
        for streams in self._streams.values():
            if rank in streams:
                streams[rank].done = True

    def poll(self, now: float | None = None) -> None:
        """Write every line that is due: complete across ranks, or older than the merge window."""
        if not self._holding:
            return
        now = time.monotonic() if now is None else now
        for name, streams in self._streams.items():
            self._release_stale_partials(name, streams, now)
            while self._flush_heads(name, streams, now, force=False):
                pass

    def flush(self) -> None:
        """Write everything held back (at the end of a cell, or before a rich output)."""
        if not self._holding:
            return
        self._holding = False
        self._write_held_lines()
        for name, streams in self._streams.items():
            for rank, state in streams.items():
                if not state.partial:
                    continue
                if not state.done and self._live.hold(rank, name, state.partial):
                    self._holding = True  # a progress bar still going: its display stays open
                    continue
                line = self._live.end(rank, name, state.partial)
                if line:
                    state.lines.append((line, 0.0))
                state.partial = ""
        self._write_held_lines()

    def _write_held_lines(self) -> None:
        for name, streams in self._streams.items():
            while self._flush_heads(name, streams, 0.0, force=True):
                pass

    def _release_stale_partials(self, stream: str, streams: dict[int, _RankStream], now: float) -> None:
        """A line without its newline is shown after a while anyway; one redrawn with `\\r` (a
        progress bar, streamed text) sooner, in a display of its own updated in place: it is never
        merged across ranks, so it need not wait for the others."""
        for rank, state in streams.items():
            if not state.partial:
                continue
            open_for = now - state.partial_since
            if open_for >= SHOW_AFTER_S and self._live.hold(rank, stream, state.partial):
                continue
            if open_for > PARTIAL_LINE_WINDOW_S:
                state.lines.append((state.partial, state.partial_since))
                state.partial = ""

    def _flush_heads(self, stream: str, streams: dict[int, _RankStream], now: float, force: bool) -> bool:
        waiting = {r: s for r, s in streams.items() if s.lines}
        if not waiting:
            return False
        everyone_here = all(r in waiting or s.done or s.truncated for r, s in streams.items())
        oldest = min(s.lines[0][1] for s in waiting.values())
        if not (force or everyone_here or now - oldest > MERGE_WINDOW_S):
            return False
        groups: dict[str, list[int]] = {}
        for rank, state in waiting.items():
            groups.setdefault(state.lines.popleft()[0], []).append(rank)
        for line, ranks in groups.items():
            label = rank_label(ranks, self._world_size)
            self._write(stream, f"{label} {line}" if label else line)
        return True


def notebook_color_scheme() -> str | None:
    """The kernel's IPython colour scheme (`%colors`), for the ranks to colour tracebacks alike:
    a scheme meant for a dark terminal ("linux") prints names near-white on a light theme."""
    from IPython.core.getipython import get_ipython

    return getattr(get_ipython(), "colors", None)


def write_to_kernel(stream: str, text: str) -> None:
    (sys.stdout if stream == "stdout" else sys.stderr).write(text)


def show_display(event: RichOutput, merger: StreamMerger, world_size: int) -> None:
    """A rank's display (or clear_output) during a cell, after the text it printed before it."""
    merger.flush()
    from IPython.display import clear_output, publish_display_data

    if event.kind == "clear":
        clear_output(wait=bool(event.data.get("wait")))
        return
    label = rank_label([event.rank], world_size)
    if label:
        sys.stdout.write(f"{label}\n")
        sys.stdout.flush()
    publish_display_data(event.data, event.metadata)


def show_held_output(pool: PoolHandle) -> None:
    """What ranks' own threads printed or displayed since the last cell, labelled as such."""
    if not pool.held_output:
        return
    pieces, dropped_chars, dropped_displays = pool.held_output.take()
    for rank, count in sorted(dropped_chars.items()):
        log = pool.ranks[rank].log_path if rank in pool.ranks else "its log"
        write_to_kernel("stderr", f"{_outside_label(rank, pool.world_size)} ... {count} earlier characters not "
                                  f"shown; all of it is in {log}\n")
    for rank, count in sorted(dropped_displays.items()):
        write_to_kernel("stderr", f"{_outside_label(rank, pool.world_size)} ... {count} earlier displays not shown\n")
    texts: dict[tuple[int, str], str] = {}  # a print arrives in pieces: label whole lines

    def write_texts(rank: int | None = None) -> None:
        for key in [key for key in texts if rank is None or key[0] == rank]:
            label = _outside_label(key[0], pool.world_size)
            text = texts.pop(key)
            text += "" if text.endswith("\n") else "\n"  # a display's label must start its own line
            write_to_kernel(key[1], "".join(f"{label} {line}" for line in text.splitlines(keepends=True)))

    for piece in pieces:
        if isinstance(piece, StreamOutput):
            texts[(piece.rank, piece.stream)] = texts.get((piece.rank, piece.stream), "") + piece.text
        elif piece.kind == "display":
            write_texts(piece.rank)  # what the rank printed before it displayed this
            from IPython.display import publish_display_data

            write_to_kernel("stdout", f"{_outside_label(piece.rank, pool.world_size)}\n")
            sys.stdout.flush()
            publish_display_data(piece.data, piece.metadata)
    write_texts()


def _outside_label(rank: int, world_size: int) -> str:
    return f"{rank_label([rank], world_size) or '[rank 0]'} (outside a cell)"


class WaitingLine:
    """One line, updated in place, saying where each rank of a waiting cell is."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._handle = None
        self._text = ""

    def show(self, elapsed_s: float, ranks: tuple[int, ...], activity: dict[int, RankActivity],
             finished: set[int], timeout_s: float | None = None, stopped: dict[int, int] | None = None,
             waiting_for_input: set[int] | None = None, time_left: dict[int, float] | None = None) -> None:
        """`time_left`: per rank in a collective, about how long until its timeout ends the wait."""
        waiting_for_input = waiting_for_input or set()
        text = f"waiting {elapsed_s:.0f} s: " + "; ".join(
            self._describe(ranks, activity, finished, stopped or {}, waiting_for_input, time_left or {}))
        if timeout_s is not None and any(a.collective for r, a in activity.items()
                                         if r not in finished and r not in waiting_for_input):
            text += (f" (a collective times out after {timeout_s:g} s, `--timeout` sets it; "
                     "the stop button ends the wait)")
        if text == self._text:
            return
        self._text = text
        bundle = {"text/plain": text}
        if self._handle is None:
            from IPython.display import display

            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    def _describe(self, ranks: tuple[int, ...], activity: dict[int, RankActivity], finished: set[int],
                  stopped: dict[int, int], waiting_for_input: set[int], time_left: dict[int, float]) -> list[str]:
        groups: dict[str, list[int]] = {}
        for rank in ranks:
            if rank in stopped:
                what = f"stopped by a signal (`kill -CONT {stopped[rank]}` resumes it; the stop button restarts the pool)"
            elif rank in waiting_for_input and rank not in finished:
                what = "waiting for input"
            else:
                what = self._one_rank(rank, activity.get(rank), finished, time_left.get(rank))
            groups.setdefault(what, []).append(rank)
        left_out = [rank for rank in range(self._world_size) if rank not in ranks]
        if left_out:  # `--ranks`: a collective there waits for ranks that never enter it
            groups["not running this cell"] = left_out
        return [f"{rank_label(members, self._world_size) or '[rank 0]'} {what}" for what, members in groups.items()]

    @staticmethod
    def _one_rank(rank: int, activity: RankActivity | None, finished: set[int], time_left: float | None) -> str:
        if rank in finished:
            return "finished"
        if activity is None:
            return "running"
        where = activity.where or "outside the cell's code"
        if not activity.collective:
            return f"at {where}"
        left = f" (times out in about {max(0, time_left):.0f} s)" if time_left is not None else ""
        return f"in {activity.collective} at {where}{left}"

    def close(self) -> None:
        """Blank the line: the cell has ended, so where its ranks waited is past."""
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)


def show_results(results: list[tuple[int, RichOutput]], world_size: int) -> None:
    """Each distinct last-expression value once, labelled with the ranks that produced it."""
    if not results:
        return
    from IPython.display import publish_display_data

    groups: dict[str, tuple[list[int], RichOutput]] = {}
    for rank, result in sorted(results, key=lambda item: item[0]):
        key = repr(sorted(result.data.items()))
        groups.setdefault(key, ([], result))[0].append(rank)
    for ranks, result in groups.values():
        label = rank_label(ranks, world_size)
        if label:
            sys.stdout.write(f"Out{label}:\n")
            sys.stdout.flush()
        publish_display_data(result.data, result.metadata)
