"""The notebook side of a pool: its lifecycle, and running a request on the ranks until they reply.

One `NotebookSession` lives in the kernel per loaded extension. It owns at most one pool, and
every magic is one call into it. Waiting for the ranks happens on the kernel's main thread, so
the stop button (SIGINT -> KeyboardInterrupt) lands here and is turned into an interrupt of
every rank that is still running.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdp2nb.frontend.cell_transform import notebook_execution_count, transform_and_check
from fsdp2nb.frontend.render import (
    RankError,
    StreamMerger,
    WaitingLine,
    notebook_color_scheme,
    rank_exit_error,
    show_display,
    show_held_output,
    show_results,
    write_to_kernel,
)
from fsdp2nb.pool.launcher import LocalLauncher
from fsdp2nb.pool.pool import PoolStartError, WorkerPool, describe_exit
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.protocol import (
    CellFinished,
    ControlMessage,
    ErrorInfo,
    EventMessage,
    Interrupt,
    PullValue,
    PushValues,
    RankActivity,
    RankExited,
    ReportActivity,
    RichOutput,
    RunCell,
    StreamOutput,
    TaskProgress,
)
from fsdp2nb.wire.sigint import SigintNotes, sigint_noted

if TYPE_CHECKING:
    from fsdp2nb.frontend.background import BackgroundRuns

logger = logging.getLogger(__name__)

ERROR_GRACE_S = 3.0
"""After a rank fails, how long the others may go on before they are interrupted."""
INTERRUPT_GRACE_S = 5.0
"""After an interrupt, how long ranks may take to return before the pool is restarted."""
WAITING_REPORT_S = 3.0
"""After this long without output from a cell, the ranks are asked where they are; a collective
that not every rank entered would otherwise wait silently for the whole collective timeout."""
RESUME_HINT = ("to resume, run the cells that set up the ranks again (model, optimizer, Checkpointer); "
               "`ckpt.load(\"latest\")` then continues from the last checkpoint saved")
_ACTIVITY_INTERVAL_S = 2.0
_POLL_S = 0.1


class PoolMismatchError(RuntimeError):
    """A cell asked for a pool other than the running one."""


@dataclass
class CellProgress:
    """What the kernel knows about one request while it runs."""

    ranks: tuple[int, ...]
    finished: dict[int, CellFinished]
    errors: list[tuple[int, ErrorInfo]]
    results: list[tuple[int, RichOutput]]
    first_error_at: float | None = None
    interrupted_at: float | None = None
    task_bar: object | None = None
    """The cell's progress bar (frontend.progress_view), made when the ranks first report progress."""
    started_at: float = field(default_factory=time.monotonic)
    last_output_at: float = field(default_factory=time.monotonic)
    activity_asked_at: float = 0.0
    activity: dict[int, RankActivity] = field(default_factory=dict)
    """Where each rank was when last asked (RankActivity), while the cell waited."""
    waiting_line: WaitingLine | None = None
    stopped: dict[int, int] = field(default_factory=dict)
    """Ranks that did not answer because a signal stopped them (rank -> pid), as last seen."""
    diverged_at: float | None = None
    """When the ranks were first seen at diverging points (see _ranks_diverge)."""

    @property
    def running(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished]


class NotebookSession:
    """Owns the pool of one kernel; the magics call its methods."""

    def __init__(self, pool_factory: Callable[[PoolSpec], WorkerPool] | None = None) -> None:
        self.pool: WorkerPool | None = None
        self.launcher: LocalLauncher | None = None
        """Starts this session's pools, and keeps a standby agent for the next (None where
        `pool_factory` was given: that factory launches its own)."""
        if pool_factory is None:
            self.launcher = LocalLauncher()
            pool_factory = self._pool_with_standby
        self._pool_factory = pool_factory
        self._cell_ids = itertools.count(1)
        self.background: BackgroundRuns | None = None
        """Background runs (`%%fsdp2 --bg`), made by the first one; see frontend/background.py."""
        self.lifecycle_lock = threading.RLock()
        """Held while the pool is started, stopped or replaced: the dashboard's Restart runs on a
        subshell thread, and a cell started meanwhile must get the new pool, not a half-stopped one."""

    # --- pool lifecycle -----------------------------------------------------------------------

    def _pool_with_standby(self, spec: PoolSpec) -> WorkerPool:
        """A pool on this host launches through the session's launcher (and its standby agent);
        one across hosts through the engine its spec names."""
        return WorkerPool(spec, launcher=self.launcher if spec.placement is None else None)

    def start(self, spec: PoolSpec) -> WorkerPool:
        with self.lifecycle_lock:
            return self._start(spec)

    def _start(self, spec: PoolSpec) -> WorkerPool:
        if self.pool is not None and self.pool.state in ("ready", "starting"):
            raise PoolMismatchError(
                f"a pool ({self.pool.spec.describe()}) is already running; `%fsdp2 restart` replaces it")
        self.stop(keep_standby=True)
        started = time.perf_counter()
        pool = self._pool_factory(spec)
        pool.start()
        self.pool = pool
        for note in pool.start_notes:
            print(note, file=sys.stderr)
        logger.info("started %d ranks in %.1f s", spec.world_size, time.perf_counter() - started)
        if self.launcher is not None and spec.placement is None:
            self.launcher.start_standby()  # the next restart forks from it (see pool/launcher.py)
        return pool

    def stop(self, *, polite: bool = True, keep_standby: bool = False) -> bool:
        """Stop the pool if there is one; returns whether there was. Safe to call twice.

        `polite=False` skips asking the ranks to exit, for ranks known to be stuck or dead.
        The standby agent ends too, unless a new pool is about to start (`keep_standby`)."""
        with self.lifecycle_lock:
            pool, self.pool = self.pool, None
            if self.launcher is not None and not keep_standby:
                self.launcher.close()
        if pool is None:
            return False
        # Busy ranks (a background run at kernel exit) read no exit request until their cell ends.
        pool.stop(polite=polite and not pool.busy_ranks)
        return True

    def restart(self, spec: PoolSpec | None = None) -> WorkerPool:
        with self.lifecycle_lock:
            spec = spec or (self.pool.spec if self.pool else None)
            if spec is None:
                raise PoolMismatchError("no pool to restart; start one with `%fsdp2 start --cpu N` or `--gpus N`")
            self.stop(keep_standby=True)
            return self._start(spec)

    def pool_for(self, spec: PoolSpec | None, default: Callable[[], PoolSpec]) -> WorkerPool:
        """The running pool if it matches `spec` (None: any), else a new one. Never drops state silently."""
        with self.lifecycle_lock:
            return self._pool_for(spec, default)

    def _pool_for(self, spec: PoolSpec | None, default: Callable[[], PoolSpec]) -> WorkerPool:
        pool = self.pool
        if pool is not None and not pool.check_agent():
            pool = self._replace_dead_pool(pool)
        if pool is not None and pool.state == "broken":
            raise PoolMismatchError(f"the pool is broken ({self._broken_reason()}); "
                                    "`%fsdp2 restart` starts a fresh one (rank state is lost)")
        if pool is None:
            return self._start(spec or default())
        if spec is not None and spec != pool.spec:
            raise PoolMismatchError(
                f"this cell asks for {spec.describe()} but the running pool is {pool.spec.describe()}; "
                f"`%fsdp2 restart {spec.describe()}` replaces it (rank state is lost)")
        return pool

    def _replace_dead_pool(self, pool: WorkerPool) -> WorkerPool:
        """The host agent died between cells, taking the ranks with it: start afresh and say so."""
        note = self._restart_after_failure(pool.spec, f"{pool.broken_reason} while the pool was idle")
        write_to_kernel("stderr", note + "\n")
        if self.pool is None:
            raise PoolMismatchError(f"{pool.broken_reason}, and a new pool did not start; "
                                    f"`%fsdp2 start {pool.spec.describe()}` tries again")
        return self.pool

    def _broken_reason(self) -> str:
        if self.pool and self.pool.broken_reason:
            return self.pool.broken_reason
        if self.pool and self.pool.exited:
            report = next(iter(self.pool.exited.values()))
            return f"rank {report.rank} exited, {describe_exit(report)}"
        return "a rank stopped answering"

    # --- requests -----------------------------------------------------------------------------

    def run_cell(self, pool: WorkerPool, code: str, ranks: tuple[int, ...]) -> None:
        """Run `code` on `ranks`, streaming output; raises RankError if any rank raised."""
        transformed = transform_and_check(code)
        count, scheme = notebook_execution_count(), notebook_color_scheme()
        self.run_request(pool, ranks, lambda cell_id: RunCell(cell_id=cell_id, code=code, transformed=transformed,
                                                              execution_count=count, color_scheme=scheme))

    def push(self, pool: WorkerPool, payload: bytes) -> None:
        self.run_request(pool, tuple(range(pool.world_size)),
                         lambda cell_id: PushValues(cell_id=cell_id, payload=payload))

    def pull(self, pool: WorkerPool, name: str, reply_ranks: tuple[int, ...]) -> dict[int, bytes]:
        progress = self.run_request(pool, tuple(range(pool.world_size)),
                                    lambda cell_id: PullValue(cell_id=cell_id, name=name, reply_ranks=reply_ranks))
        return {rank: progress.finished[rank].value for rank in reply_ranks}

    def next_cell_id(self) -> int:
        """A fresh request id (itertools.count: atomic, so any thread may take one)."""
        return next(self._cell_ids)

    def run_request(self, pool: WorkerPool, ranks: tuple[int, ...],
                    make_request: Callable[[int], ControlMessage]) -> CellProgress:
        cell_id = next(self._cell_ids)
        request = make_request(cell_id)
        # The stop button only takes note while a request is sent and waited for: sent to all
        # ranks or none, and never between an event taken off the queue and its recording.
        # This thread reads the ranks' replies itself, from before they can come: a hop through
        # the pool's receiving thread would cost each reply a thread wake-up.
        with sigint_noted() as stop_button, pool.events_read_here():
            # Sent first: what follows runs while the ranks wake up.
            try:
                pool.send(ranks, request)
            except ConnectionError as error:  # a rank gone between cells, its end not yet reported
                self._after_unreachable_rank(pool, ranks, error)
            progress = CellProgress(ranks=ranks, finished={}, errors=[], results=[])
            pool.busy_ranks.update(ranks)
            merger = StreamMerger(ranks, pool.world_size, write_to_kernel,
                                  {r: info.log_path for r, info in pool.ranks.items()})
            try:
                show_held_output(pool)  # printed by ranks' own threads since the last cell: first
                self.wait(pool, cell_id, progress, merger, stop_button)
                merger.flush()  # the cell's own output first
                show_held_output(pool)  # then what was still on its way when the cell began
            finally:
                pool.busy_ranks.clear()
                merger.flush()  # ipykernel flushes its streams itself before a display or an error
                if progress.task_bar is not None:
                    progress.task_bar.close()
                if progress.waiting_line is not None:
                    progress.waiting_line.close()
        show_results(progress.results, pool.world_size)
        if progress.errors:
            raise RankError(progress.errors, pool.world_size, notes=self.after_collective_timeout(pool, progress))
        return progress

    def wait(self, pool: WorkerPool, cell_id: int, progress: CellProgress, merger: StreamMerger,
             stop_button: SigintNotes | None) -> None:
        """Take the ranks' events for request `cell_id` until each rank in `progress` finished.

        A rank that failed while others wait is interrupted after ERROR_GRACE_S; ranks that do not
        return INTERRUPT_GRACE_S after an interrupt (or a second stop-button press) get a new pool."""
        while progress.running:
            event = pool.next_event(_POLL_S)  # a press during the wait is acted on within _POLL_S
            if event is not None:
                self._handle(event, cell_id, progress, merger, pool.world_size)
            elif not pool.check_agent():
                self._after_agent_death(pool, progress, merger)
            merger.poll()
            self._enforce_deadlines(pool, cell_id, progress, merger)
            self._ask_quiet_ranks(pool, cell_id, progress)
            if stop_button is not None and stop_button.take() and progress.running:
                if progress.interrupted_at is None:
                    self._interrupt(pool, cell_id, progress)
                # A second stop-button press while waiting means: do not wait any longer.
                else:
                    self._recover(pool, progress, merger, "the ranks did not return after a second interrupt")

    def _handle(self, event: EventMessage, cell_id: int, progress: CellProgress, merger: StreamMerger,
                world_size: int) -> None:
        if isinstance(event, RankExited):
            merger.flush()
            raise RankError([(event.rank, rank_exit_error(event))], world_size,
                            notes=self._after_dead_rank(event))
        if getattr(event, "cell_id", cell_id) != cell_id:
            return  # late output of an earlier, abandoned request
        if not isinstance(event, (CellFinished, RankActivity)):
            progress.last_output_at = time.monotonic()
        if isinstance(event, StreamOutput):
            merger.feed(event.rank, event.stream, event.text)
        elif isinstance(event, RichOutput):
            if event.kind == "result":  # shown once the cell ends, alike values once
                progress.results.append((event.rank, event))
            else:
                show_display(event, merger, world_size)
        elif isinstance(event, TaskProgress):
            if progress.task_bar is None:
                from fsdp2nb.frontend.progress_view import CellTaskBar

                merger.flush()  # what the ranks printed before the work began comes first
                progress.task_bar = CellTaskBar(world_size)
            progress.task_bar.update(event)
        elif isinstance(event, RankActivity):
            progress.activity[event.rank] = event
            self._show_waiting_line(progress, merger, world_size)
        elif isinstance(event, CellFinished):
            progress.finished[event.rank] = event
            merger.rank_done(event.rank)
            if event.error is not None:
                progress.errors.append((event.rank, event.error))
                progress.first_error_at = progress.first_error_at or time.monotonic()


    def _enforce_deadlines(self, pool: WorkerPool, cell_id: int, progress: CellProgress,
                           merger: StreamMerger) -> None:
        """A rank failed while others wait (likely in a collective): interrupt, then restart."""
        if not progress.running:  # the last rank returned in this very pass
            return
        now = time.monotonic()
        if progress.interrupted_at is None and progress.first_error_at is not None:
            if now - progress.first_error_at > ERROR_GRACE_S:
                self._interrupt(pool, cell_id, progress)
        elif progress.interrupted_at is not None and now - progress.interrupted_at > INTERRUPT_GRACE_S:
            stuck = ", ".join(map(str, progress.running))
            self._recover(pool, progress, merger, f"rank(s) {stuck} did not return within "
                                                  f"{INTERRUPT_GRACE_S:g} s of the interrupt")

    def _interrupt(self, pool: WorkerPool, cell_id: int, progress: CellProgress) -> None:
        progress.interrupted_at = time.monotonic()
        for rank in progress.running:
            try:
                pool.send(rank, Interrupt(cell_id=cell_id), connect_timeout_s=0)
                # Where it was, in case it does not return: the error then names its line.
                pool.send(rank, ReportActivity(cell_id=cell_id), connect_timeout_s=0)
            except ConnectionError:
                pass

    def _ask_quiet_ranks(self, pool: WorkerPool, cell_id: int, progress: CellProgress) -> None:
        """After WAITING_REPORT_S without output, ask the running ranks where they are, now and then."""
        now = time.monotonic()
        if now - progress.last_output_at < WAITING_REPORT_S or now - progress.activity_asked_at < _ACTIVITY_INTERVAL_S:
            return
        progress.activity_asked_at = now
        for rank in progress.running:
            if pool.rank_process_state(rank) in ("", "zombie"):  # ended, and no agent told (it is stopped)
                self._after_unreachable_rank(pool, (rank,), ConnectionError(
                    f"rank {rank}'s process ended and nothing reported it"))
        for rank in progress.running:
            try:
                pool.send(rank, ReportActivity(cell_id=cell_id), connect_timeout_s=0)
            except ConnectionError:
                pass

    def _show_waiting_line(self, progress: CellProgress, merger: StreamMerger, world_size: int) -> None:
        """Shown once the ranks' positions diverge in two samples running: some finished while others
        go on, or a rank waits in a collective that others are not in (ranks left out by `--ranks`
        included). Ranks computing quietly, or all in the same collective, show nothing."""
        running = progress.running
        if not running:
            return
        pool = self.pool
        progress.stopped = {rank: pool.ranks[rank].pid for rank in running if rank not in progress.activity
                            and rank in pool.ranks and pool.rank_process_state(rank) == "stopped"} if pool else {}
        if not _ranks_diverge(progress, world_size):
            progress.diverged_at = None
            return
        now = time.monotonic()
        progress.diverged_at = progress.diverged_at or now
        if progress.waiting_line is None and not progress.stopped and now - progress.diverged_at < _ACTIVITY_INTERVAL_S:
            return  # one sample can catch ranks of a healthy loop at different points; wait for the next
        if progress.waiting_line is None:
            merger.flush()  # what the ranks printed comes before the line
            progress.waiting_line = WaitingLine(world_size)
        progress.waiting_line.show(time.monotonic() - progress.started_at, progress.ranks, progress.activity,
                                   finished=set(progress.finished), timeout_s=self._collective_timeout_s(),
                                   stopped=progress.stopped)

    def _collective_timeout_s(self) -> float | None:
        return self.pool.spec.collective_timeout_s if self.pool is not None else None

    def _recover(self, pool: WorkerPool, progress: CellProgress, merger: StreamMerger, why: str) -> None:
        """Replace a pool whose ranks are stuck, then end the cell saying that state was lost."""
        merger.flush()
        not_returned = [(rank, self._not_returned(pool, rank, progress)) for rank in progress.running]
        stopped = [str(rank) for rank, error in not_returned if error.ename == "RankStopped"]
        stuck = [str(rank) for rank, error in not_returned if error.ename != "RankStopped"]
        what = "; ".join(f"{kind}: rank(s) {', '.join(ranks)}" for kind, ranks in
                         (("stopped", stopped), ("stuck", stuck)) if ranks)
        note = self._restart_after_failure(pool.spec, f"{why} ({what})")
        raise RankError(progress.errors + not_returned, pool.world_size, notes=(note,))

    @staticmethod
    def _not_returned(pool: WorkerPool, rank: int, progress: CellProgress) -> ErrorInfo:
        """What to say of a rank that did not return: stopped by a signal, or stuck at a line."""
        info = pool.ranks.get(rank)
        if pool.rank_process_state(rank) == "stopped":
            pid = info.pid if info else "?"
            return ErrorInfo("RankStopped", f"is stopped by a signal (SIGSTOP or SIGTSTP) and cannot run; "
                                            f"`kill -CONT {pid}` would have resumed it", ())
        activity = progress.activity.get(rank)
        where = f" (at {activity.where})" if activity is not None and activity.where else ""
        return ErrorInfo("RankStuck", f"did not return after the interrupt{where}: it ignored it or "
                                      "is inside code that cannot be interrupted", ())

    def _after_agent_death(self, pool: WorkerPool, progress: CellProgress, merger: StreamMerger) -> None:
        """The host agent died mid-cell; its ranks died with it: end the cell and start afresh."""
        merger.flush()
        reason = pool.broken_reason or "the host agent died"
        errors = [(rank, ErrorInfo("RankDied", f"ended with its host agent: {reason}", ()))
                  for rank in progress.running]
        note = self._restart_after_failure(pool.spec, reason)
        raise RankError(progress.errors + errors, pool.world_size, notes=(note,))

    def _after_unreachable_rank(self, pool: WorkerPool, ranks: tuple[int, ...], error: ConnectionError) -> None:
        """A request could not reach a rank: its process is gone (the agent may still be ending
        the others). Nothing ran for certain, so start afresh and say what was found."""
        pool.check_agent()
        reason = pool.broken_reason or str(error)
        note = self._restart_after_failure(pool.spec, f"the cell could not reach its ranks ({reason})")
        raise RankError([(ranks[0], ErrorInfo("RankDied", f"could not be reached: {reason}", ()))],
                        pool.world_size, notes=(note,))

    @staticmethod
    def after_collective_timeout(pool: WorkerPool, progress: CellProgress) -> tuple[str, ...]:
        """A collective that timed out leaves the process group unusable: mark the pool broken;
        the notes for the cell's error (none if no collective timed out)."""
        timed_out = sorted(rank for rank, error in progress.errors if _is_collective_timeout(error))
        if not timed_out:
            return ()
        ranks = ", ".join(map(str, timed_out))
        timeout_s = pool.spec.collective_timeout_s
        pool.state = "broken"
        pool.broken_reason = f"a collective timed out on rank(s) {ranks} after {timeout_s:g} s"
        return (f"\x1b[1;31ma collective timed out on rank(s) {ranks} after {timeout_s:g} s: the pool's process "
                "group is unusable now\x1b[0m\n`%fsdp2 restart` starts a fresh pool (rank state is lost); "
                "`--timeout SECONDS` there sets the collective timeout",)

    def _after_dead_rank(self, event: RankExited) -> tuple[str, ...]:
        if self.pool is None:
            return ()
        return (self._restart_after_failure(self.pool.spec, f"rank {event.rank} died"),)

    def _restart_after_failure(self, spec: PoolSpec, what_happened: str) -> str:
        """Replace the pool without asking its ranks (they are stuck or dead); the note to show."""
        self.stop(polite=False, keep_standby=True)
        try:
            self.start(spec)
        except PoolStartError as error:  # say so beside why the old pool went, not instead of it
            return (f"\x1b[1;31m{what_happened}; all rank state was lost and a new pool did not start: "
                    f"{error}\x1b[0m\n`%fsdp2 start {spec.describe()}` tries again")
        return (f"\x1b[1;31m{what_happened}; the pool was restarted ({spec.describe()}) "
                f"and all rank state was lost\x1b[0m\n{RESUME_HINT}")


def _is_collective_timeout(error: ErrorInfo) -> bool:
    """A process-group timeout as gloo and torch.distributed word it."""
    text = error.evalue.lower()
    return (error.ename.startswith("Dist") or error.ename == "RuntimeError") and ("timed out" in text
                                                                                 or "timeout" in text)


def _ranks_diverge(progress: CellProgress, world_size: int) -> bool:
    """Whether the ranks are where a collective not every rank entered leaves them."""
    if progress.finished or progress.stopped:
        return True
    collectives = {progress.activity[r].collective if r in progress.activity else None for r in progress.running}
    if collectives == {None}:
        return False
    return len(collectives) > 1 or len(progress.ranks) < world_size
