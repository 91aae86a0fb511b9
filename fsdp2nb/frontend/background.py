"""Background runs: `%%fsdp2 --bg` sends a cell to the ranks and returns a handle at once.

A runner thread waits for the ranks as the kernel's main thread does for a blocking cell, and
publishes the run's output under the parent header of the cell that started it, so ipykernel
routes it into that cell's output area while other cells run. One run goes at a time: every
later request for the ranks waits for it on the main thread (the stop button ends that wait,
not the run), and fails with the run's error if the run failed and nobody has seen it yet.

A kept pool's run that a kernel takes over on attach (a `--bg` run, or a cell of a kernel that
was lost) becomes a handle here too (`taken_over_run`): its request was sent already.

Threads: the handle's state is written by the runner thread and read anywhere, under the
handle's lock; `BackgroundRuns` guards its registry with its own lock. No thread here ever
waits for the kernel's main thread.
"""

from __future__ import annotations

import contextlib
import keyword
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from fsdp2nb.errors import Fsdp2nbError, InvalidValue, NoSuchRun, RankError
from fsdp2nb.frontend.cell_transform import notebook_execution_count
from fsdp2nb.frontend.errors import alarm
from fsdp2nb.pool.kept.holder import describe_ranks

if TYPE_CHECKING:
    from fsdp2nb.frontend.notebook_input import PromptRelay
    from fsdp2nb.frontend.request_wait import RequestWait
    from fsdp2nb.pool.handle import PoolHandle
    from fsdp2nb.wire.requests import ControlMessage

logger = logging.getLogger(__name__)

RunState = Literal["running", "done", "failed", "interrupted"]
RankState = Literal["running", "done", "failed"]
MAX_LISTED_RUNS = 100
"""`%fsdp2 runs` lists this many of the latest runs (a day of cells keeps no more)."""
_WAIT_SLICE_S = 0.1  # main-thread waits wake this often, so the stop button is served promptly


class StopRequests:
    """Presses of a run's Stop (handle, line magic, dashboard), counted across threads.

    Stands in for the stop-button notes of a blocking cell: the runner's wait loop polls `take()`;
    a second press while the ranks have not returned restarts the pool, as a second stop-button
    press does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def press(self) -> None:
        with self._lock:
            self._count += 1

    def take(self) -> bool:
        with self._lock:
            came, self._count = self._count > 0, 0
        return came


class BackgroundRun:
    """The handle a `%%fsdp2 --bg` cell returns: `done()`, `wait()`, `interrupt()`, state."""

    def __init__(self, *, ranks: tuple[int, ...], execution_count: int | None, name: str | None = None,
                 clock: Callable[[], float] = time.monotonic, started_at: float | None = None,
                 prompts: PromptRelay | None = None, origin: str = "", ended_at: float | None = None,
                 output_at: str = "") -> None:
        """`started_at` (time.time()), `prompts`, `origin`, `ended_at` and `output_at` are for a
        kept pool's run that this kernel took over on attach: when it began, the relay that asks
        its prompts in the cell that waits for it, where it came from ("of kernel 4242"), when it
        ended if every rank ended it while no kernel held the pool, and where its output is."""
        self.name = name
        self.execution_count = execution_count
        self.ranks = ranks
        self.started_at = time.time() if started_at is None else started_at
        """Wall-clock start, for the line a waiting cell shows."""
        self.stops = StopRequests()
        self.prompts = prompts
        self.origin = origin
        self.output_at = output_at
        """Where a run taken over on attach shows its output ("under In[5], the attach cell, ...");
        empty for a run this kernel started, whose output is under the cell that started it."""
        self._ended_at = ended_at
        self._clock = clock
        self._started = clock() - (0.0 if started_at is None else max(0.0, time.time() - started_at))
        self._ended: float | None = None
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._rank_states: dict[int, RankState] = dict.fromkeys(ranks, "running")
        self._error: BaseException | None = None
        self._error_seen = False
        self._interrupt_asked = False

    # --- what users call ------------------------------------------------------------------------

    @property
    def label(self) -> str:
        """How messages name the run: `In[12]`, with its name if it has one."""
        cell = f"In[{self.execution_count}]" if self.execution_count is not None else "a background run"
        cell = f"{cell} {self.origin}" if self.origin else cell
        return f"{cell} ({self.name})" if self.name else cell

    @property
    def state(self) -> RunState:
        with self._lock:
            if not self._finished.is_set():
                return "running"
            if self._error is None:
                return "done"
            return "interrupted" if _is_interrupt(self._error) else "failed"

    @property
    def rank_states(self) -> dict[int, RankState]:
        with self._lock:
            return dict(self._rank_states)

    @property
    def elapsed_s(self) -> float:
        with self._lock:
            end = self._ended if self._ended is not None else self._clock()
        return end - self._started

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the run; True once it ended, False if `timeout` passed first. Raises the
        run's error as the blocking cell would have (the stop button ends the wait, not the run)."""
        if not self.wait_for_end(None if timeout is None else self._clock() + timeout):
            return False
        self.raise_error()
        return True

    def wait_for_end(self, deadline: float | None = None) -> bool:
        """Wait for the end (False at `deadline`); a run taken over on attach asks its prompts here."""
        relay = self.prompts
        with relay.waiting() if relay is not None else contextlib.nullcontext():
            while not self._finished.wait(_WAIT_SLICE_S if deadline is None
                                          else max(0.0, min(_WAIT_SLICE_S, deadline - self._clock()))):
                if relay is not None:
                    relay.answer_pending()
                if deadline is not None and self._clock() >= deadline:
                    return False
        return True

    def interrupt(self) -> None:
        """Interrupt every rank of the run (KeyboardInterrupt there); a second call while the
        ranks do not return restarts the pool, as a second stop-button press does."""
        if self._finished.is_set():
            return
        with self._lock:
            self._interrupt_asked = True
        self.stops.press()

    def ending_line(self) -> str:
        """How the run ended, in one line: `In[3] of kernel 4242 (train) on ranks 0-1: done after
        0:32; its output is under In[5], ...` (the ranks that failed, and where its output is if known)."""
        failed = sorted(rank for rank, state in self.rank_states.items() if state == "failed")
        how = f"{self.state} on {describe_ranks(failed)}" if failed else self.state
        line = f"{self.label} on {describe_ranks(list(self.ranks))}: {how} after {_clock_text(self.elapsed_s)}"
        return f"{line}; {self.output_at}" if self.output_at else line

    def summary(self) -> str:
        """One line for the dashboard: `background run In[12] (train) running 1:23`."""
        return f"background run {self.label} {self.state} {_clock_text(self.elapsed_s)}"

    def __repr__(self) -> str:
        states = self.rank_states
        counts = {s: sum(1 for v in states.values() if v == s) for s in ("running", "done", "failed")}
        ranks = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return f"<fsdp2 background run {self.label}: {self.state}, {_clock_text(self.elapsed_s)}; ranks: {ranks}>"

    # --- what the runner and the queue call -----------------------------------------------------

    def raise_error(self) -> None:
        """Raise the run's error, if it failed; from then on the error counts as seen."""
        with self._lock:
            error = self._error
            self._error_seen = True
        if error is not None:
            raise error

    def mark_error_seen(self) -> None:
        with self._lock:
            self._error_seen = True

    def unseen_error(self) -> BaseException | None:
        """The error of a run that failed on its own, if no one has raised it yet. A run
        interrupted through its handle ended as asked: that error is not passed on."""
        with self._lock:
            if self._error is None or self._error_seen:
                return None
            if self._interrupt_asked and _is_interrupt(self._error):
                return None
            return self._error

    def rank_finished(self, rank: int, failed: bool) -> None:
        with self._lock:
            self._rank_states[rank] = "failed" if failed else "done"

    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            self._ended = self._clock() - (0.0 if self._ended_at is None else max(0.0, time.time() - self._ended_at))
        self._finished.set()


def _is_interrupt(error: BaseException) -> bool:
    errors = getattr(error, "errors", None) or ()
    return isinstance(error, KeyboardInterrupt) or (
        bool(errors) and all(info.ename == "KeyboardInterrupt" for _, info in errors))


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class BackgroundRuns:
    """The runs of one session: the one going, the named ones, the latest one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: BackgroundRun | None = None
        self._latest: BackgroundRun | None = None
        self._named: dict[str, BackgroundRun] = {}
        self._started: deque[BackgroundRun] = deque(maxlen=MAX_LISTED_RUNS)

    @property
    def active(self) -> BackgroundRun | None:
        """The run going now, if any."""
        with self._lock:
            run = self._active
        return run if run is not None and not run.done() else None

    @property
    def latest(self) -> BackgroundRun | None:
        """The run started last, going or ended."""
        with self._lock:
            return self._latest

    def find(self, name: str | None) -> BackgroundRun:
        """The run called `name`, or the latest run; NoSuchRun (a usage mistake) if there is none."""
        with self._lock:
            if name is None and self._latest is not None:
                return self._latest
            if name is not None and name in self._named:
                return self._named[name]
            known = ", ".join(sorted(self._named)) or "none"
        if name is None:
            raise NoSuchRun("no background run yet; start one with `%%fsdp2 --bg`")
        raise NoSuchRun(f"no background run is called {name!r} (named runs: {known})")

    def add(self, run: BackgroundRun) -> None:
        with self._lock:
            assert self._active is None or self._active.done(), "one background run at a time"
            self._active = self._latest = run
            self._started.append(run)
            if run.name:
                self._named[run.name] = run

    def listing(self) -> RunList:
        """The runs of this session, oldest first (`%fsdp2 runs`)."""
        with self._lock:
            return RunList(self._started)

    def wait_for_active(self, say: Callable[[str], object]) -> None:
        """Before a request for the ranks: wait for the run going (saying so in one line), then
        raise its error if it failed unseen. On the main thread the stop button ends the wait."""
        run = self.active
        if run is not None:
            say(f"waiting for {run.label}, started {time.strftime('%H:%M', time.localtime(run.started_at))}\n")
            run.wait_for_end()
        with self._lock:
            latest = self._latest
        error = latest.unseen_error() if latest is not None else None
        if latest is not None and error is not None:
            latest.mark_error_seen()
            raise _queued_failure(latest, error)


class RunList(list):
    """`%fsdp2 runs`: the session's background runs, shown one line each (`x = %fsdp2 runs` keeps
    the handles, to wait for or interrupt)."""

    def __repr__(self) -> str:
        if not self:
            return "no background runs in this session; start one with `%%fsdp2 --bg`"
        return "\n".join(run.summary().removeprefix("background run ") for run in self)

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython's display of the value
        printer.text(repr(self))


def _queued_failure(run: BackgroundRun, error: BaseException) -> BaseException:
    """The run's error for a cell queued behind it, saying that this cell did not run."""
    note = alarm(f"the background run {run.label} failed, so this cell did not run "
                 "(as in sequence); run it again to run it")
    if isinstance(error, RankError):
        return RankError(error.errors, error.world_size, notes=(*error.notes, note))
    return BackgroundRunFailed(f"the background run {run.label} failed ({type(error).__name__}: {error}); "
                               "this cell did not run")


class BackgroundRunFailed(Fsdp2nbError, RuntimeError):
    """A cell queued behind a background run that failed (with an error other than the ranks'):
    the cell did not run, as it would not have in sequence."""


def check_run_name(name: str | None) -> None:
    """A name binds the handle in the notebook, so it must be a plain identifier."""
    if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
        raise InvalidValue(f"--name takes a Python identifier to bind the run's handle to, got {name!r}")


def start_background_run(runs: BackgroundRuns, wait: RequestWait, request: ControlMessage,
                         run: BackgroundRun) -> None:
    """Send the request now and hand the wait for its replies to a runner thread."""
    shell = _shell()
    parent = shell.get_parent() if hasattr(shell, "get_parent") else None
    wait.send(request)  # marks the ranks busy before returning: a Stop or Save click sees the run at once
    runs.add(run)
    thread = threading.Thread(target=_run, args=(wait, run, shell, parent), daemon=True,
                              name=f"fsdp2nb-run-{run.execution_count}")
    thread.start()


def resume_background_run(runs: BackgroundRuns, wait: RequestWait, run: BackgroundRun,
                          busy_since: dict[int, float]) -> None:
    """Wait here for a run a lost kernel started (a kept pool): its request was sent already;
    `busy_since`: when each rank started it."""
    shell = _shell()
    parent = shell.get_parent() if hasattr(shell, "get_parent") else None
    wait.pool.mark_busy(wait.progress.ranks, since=busy_since)
    runs.add(run)
    thread = threading.Thread(target=_run, args=(wait, run, shell, parent), daemon=True,
                              name=f"fsdp2nb-run-{run.execution_count}")
    thread.start()


def requests_at_attach(pool: PoolHandle) -> dict[int, int]:
    """Rank -> the request this kernel waits for: every rank the board showed running (ranks
    mark a request ended before replying, so each replies to this kernel), whatever request it
    runs, and every rank that holds the reply to one that ended while no kernel held the pool."""
    cell_ids = {rank: slot.running_cell_id for rank, slot in enumerate(pool.work_at_attach)
                if slot.running_cell_id is not None and rank not in pool.exited}
    cell_ids.update({rank: ready.held_reply for rank, ready in pool.ranks.items()
                     if ready.held_reply is not None and rank not in cell_ids})
    return cell_ids


def taken_over_run(pool: PoolHandle, cell_ids: dict[int, int], relay: PromptRelay,
                    ) -> tuple[BackgroundRun, dict[int, float]]:
    """The handle, named as the kernel that started the run noted it (else from the board), and
    when each rank still running started."""
    first = min(cell_ids.values())
    noted = pool.noted_background_run(first)
    running = {rank: slot for rank, slot in enumerate(pool.work_at_attach)
               if rank in cell_ids and slot.running_cell_id is not None}
    busy_since = {rank: slot.since for rank, slot in running.items()}
    count = next((slot.execution_count for slot in running.values() if slot.running_cell_id == first), None)
    # A rank that holds its reply ended the run while no kernel held the pool, when its slot last changed.
    ended = [slot.since for rank, slot in enumerate(pool.work_at_attach) if rank in cell_ids and rank not in running]
    run = BackgroundRun(
        ranks=tuple(sorted(cell_ids)), prompts=relay,
        started_at=noted.started if noted else min(busy_since.values(), default=time.time()),
        execution_count=noted.execution_count if noted else count, name=noted.name if noted else None,
        origin=f"of kernel {noted.kernel_pid}" if noted else "of another kernel",
        ended_at=max(ended) if ended and not running else None,
        output_at=_taken_over_output(pool.log_dir))
    return run, busy_since


def _taken_over_output(log_dir: str) -> str:
    """Where a run taken over by the running (attach) cell shows its output: under that cell from
    now on, and in the ranks' logs all along (what it printed while no kernel held the pool too)."""
    count = notebook_execution_count()
    cell = f"In[{count}], the attach cell," if count is not None else "the attach cell"
    return f"its output is under {cell} and in the rank logs in {log_dir}"


def _run(wait: RequestWait, run: BackgroundRun, shell, parent) -> None:
    """The runner: the blocking cell's wait, on this thread, which reads the run's events itself
    (pool/event_reader.py); its output goes to this thread's parent cell."""
    tokens = shell.set_thread_parent(parent) if parent is not None and hasattr(shell, "set_thread_parent") else None
    error: BaseException | None = None
    try:
        wait.wait_for_replies()
    except BaseException as caught:  # every failure belongs to the run, shown in its cell
        error = caught
        try:
            _show_error(shell, caught)
        except Exception:  # the handle still ends and carries the error
            logger.exception("fsdp2nb: could not show the error of %s", run.label)
    finally:
        _flush_streams()
        if tokens is not None:
            shell.reset_thread_parent(tokens)
        run.finish(error)


def _show_error(shell, error: BaseException) -> None:  # an IPython shell
    """The run's error as an `error` output in its own cell (this thread's parent header)."""
    render = getattr(error, "_render_traceback_", None)
    lines = render() if render else traceback.format_exception(error)
    _flush_streams()
    hook = getattr(shell, "displayhook", None)
    if hook is None or getattr(hook, "session", None) is None:  # not ipykernel: plain text
        sys.stderr.write("\n".join(lines) + "\n")
        return
    from ipykernel.jsonutil import json_clean

    content = {"traceback": lines, "ename": type(error).__name__, "evalue": str(error)}
    hook.session.send(hook.pub_socket, "error", json_clean(content), hook.parent_header)


def _flush_streams() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _shell():  # the running IPython shell
    from IPython import get_ipython

    return get_ipython()
