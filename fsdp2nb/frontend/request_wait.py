"""The wait for one request's replies: the loop every request to the ranks goes through.

A blocking cell runs it on the kernel's main thread, where the stop button is only noted
(`sigint_noted`) and acted on between steps; a background run runs it on its runner thread, where
its Stop presses stand in for the button. Until every rank has replied it streams the ranks'
output, relays their prompts for input to the notebook one at a time (frontend/rank_prompts.py),
releases ranks from collectives that cannot complete (frontend/released_collectives.py) or, where
the groups cannot be re-formed, interrupts them after a rank failed, and when ranks are dead or
stuck hands the pool to `recover` (the session restarts it) and ends with the error to show.
`wait_for_replies()` ends every wait the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from fsdp2nb.frontend.cell_progress import CellProgress
from fsdp2nb.frontend.errors import PoolTakenError, RankError, rank_exit_error
from fsdp2nb.frontend.output import (
    StreamMerger,
    WaitingLine,
    show_display,
    show_held_output,
    show_results,
    write_to_kernel,
)
from fsdp2nb.frontend.rank_prompts import AskInput, RankPrompts
from fsdp2nb.frontend.released_collectives import CollectiveRelease, Reform, ranks_diverge
from fsdp2nb.frontend.waiting_ranks import rank_waits
from fsdp2nb.wire.events import (
    CellFinished,
    EventMessage,
    InputRequested,
    RankActivity,
    RankExited,
    RichOutput,
    StreamOutput,
    TaskProgress,
)
from fsdp2nb.wire.records import ErrorInfo
from fsdp2nb.wire.requests import ControlMessage, Interrupt, ReportActivity

if TYPE_CHECKING:
    from fsdp2nb.pool.handle import PoolHandle
    from fsdp2nb.pool.spec import PoolSpec

ERROR_GRACE_S = 3.0
"""After a rank fails, how long the others may go on before they are interrupted (where groups
can be re-formed, a rank seen waiting in a collective is released at once instead)."""
_ASK_AFTER_ERROR_S = 0.25
"""After a rank failed, how often the others are asked where they are: one that enters a
collective is released without waiting for the interrupt."""
INTERRUPT_GRACE_S = 5.0
"""After an interrupt or a release, how long ranks may take to return before the pool is restarted."""
WAITING_REPORT_S = 3.0
"""After this long without output from a cell, the ranks are asked where they are; a collective
that not every rank entered would otherwise wait silently for the whole collective timeout."""
EXIT_CAUSE_GRACE_S = 2.0
"""How long a request that could not reach a rank waits to learn why (see wait_for_exit_cause)."""
_ACTIVITY_INTERVAL_S = 2.0
_HOLDER_CHECK_S = 1.0
"""While no event comes, how often a kept pool's attach record is read: another kernel may have
taken the pool, and with it the replies this request waits for."""
_POLL_S = 0.1


class StopPresses(Protocol):
    """The stop button's notes (`SigintNotes`) or a background run's Stop presses."""

    def take(self) -> bool: ...


Recover = Callable[["PoolSpec", str], str]
"""Replaces a pool whose ranks are dead or stuck; given what happened, returns the note to show."""


class RequestWait:
    """Sends one request to `ranks` and takes their events until each replied."""

    def __init__(self, pool: PoolHandle, cell_id: int, ranks: tuple[int, ...], *, recover: Recover,
                 ask_input: AskInput, stop_presses: StopPresses | None = None,
                 on_rank_finished: Callable[[int, bool], None] | None = None,
                 cell_ids: dict[int, int] | None = None, before_prompt: Callable[[], bool] | None = None,
                 started_at: float | None = None, reform: Reform | None = None) -> None:
        """`cell_ids`: rank -> the request it runs, where ranks run different ones (a kept pool's
        runs taken over on attach; default: `cell_id` on every rank). `before_prompt` is called
        on the waiting thread before a prompt is shown; False: no one can answer yet, it waits.
        `started_at`: when the request began (time.time()), if before this wait. `reform`: re-forms
        the process groups after a failed collective; without it (pools whose groups cannot be
        re-formed) ranks left in a collective are interrupted, then the pool is restarted."""
        self.pool = pool
        self.cell_id = cell_id
        self._cell_ids = cell_ids or dict.fromkeys(ranks, cell_id)
        self._own_cell_ids = frozenset(self._cell_ids.values())
        self.progress = CellProgress(ranks=ranks)
        if started_at is not None:
            self.progress.started_at -= max(0.0, time.time() - started_at)
        self._recover_pool = recover
        self._release = CollectiveRelease(self.progress, pool, self._cell_ids, cell_id,
                                          reform if not pool.spec.uses_gpus else None)  # NCCL groups: not yet
        self._stop_presses = stop_presses
        self._on_rank_finished = on_rank_finished
        self._merger = StreamMerger(ranks, pool.world_size, write_to_kernel,
                                    {r: info.log_path for r, info in pool.ranks.items()})
        self._prompts = RankPrompts(self.progress, pool, self._cell_ids, self._merger, ask_input=ask_input,
                                    before_prompt=before_prompt, handle=self._handle,
                                    note_activity=self._note_activity,
                                    show_waiting_line=self._show_waiting_line_now, stop_pressed=self._stop_pressed)

    def send(self, request: ControlMessage) -> None:
        """Mark the ranks busy, then send; a rank found gone ends the request with the cause."""
        self.pool.mark_busy(self.progress.ranks)
        try:
            self.pool.send(self.progress.ranks, request)
        except ConnectionError as error:  # a rank gone between cells, or ended by the request itself
            self.pool.mark_idle(self.progress.ranks)
            self._after_unreachable_rank(error)

    def wait_for_replies(self) -> CellProgress:
        """Wait until every rank replied, show what they left (values, errors), raise RankError
        if any rank failed. Output the ranks printed between cells comes first."""
        try:
            show_held_output(self.pool)
            self._wait()
            self._merger.flush()  # the request's own output first
            show_held_output(self.pool)  # then what was still on its way when it began
        finally:
            self._close()
        show_results(self.progress.results, self.pool.world_size)
        if self.progress.errors or self.progress.released_at is not None:
            errors, notes = self._release.outcome()
            if errors:
                raise RankError(errors, self.pool.world_size, notes=notes)
            write_to_kernel("stderr", "".join(f"{note}\n" for note in notes))
        return self.progress

    def _close(self) -> None:
        self.pool.mark_idle(self.progress.ranks)
        self._merger.flush()  # ipykernel flushes its streams itself before a display or an error
        if self.progress.task_bar is not None:
            self.progress.task_bar.close()
        if self.progress.waiting_line is not None:
            self.progress.waiting_line.close()

    # --- the loop -----------------------------------------------------------------------------

    def _wait(self) -> None:
        """A rank that failed while others wait is interrupted after ERROR_GRACE_S; ranks that do
        not return INTERRUPT_GRACE_S after an interrupt (or a second press) get a new pool."""
        progress = self.progress
        while progress.running:
            event = self.pool.next_event(_POLL_S)  # a press during the wait is acted on within _POLL_S
            if event is not None:
                self._handle(event)
            elif not self.pool.check_agent():
                self._after_agent_death()
            else:
                self._check_still_held()
            self._merger.poll()
            self._prompts.answer_due()
            self._enforce_deadlines()
            self._ask_quiet_ranks()
            if self._stop_presses is not None and self._stop_presses.take() and progress.running:
                self._stop_pressed()

    def _check_still_held(self) -> None:
        """End the request if another kernel took the kept pool: the ranks go on there and reply
        to it, so this kernel would wait forever."""
        progress, now, keep = self.progress, time.monotonic(), self.pool.keep
        if keep is None or now - progress.holder_checked_at < _HOLDER_CHECK_S:
            return
        progress.holder_checked_at = now
        if self.pool.held_here():
            return
        self._merger.flush()
        name = keep.name
        raise PoolTakenError(f"kept pool {name!r} was taken by {self.pool.holder_note()} while this request ran; "
                             f"its ranks go on there (`%fsdp2 attach {name} --take` takes it back)")

    def _stop_pressed(self) -> None:
        progress = self.progress
        if progress.interrupted_at is None or progress.interrupted_after_error:
            progress.interrupted_after_error = False  # the first press: what the ranks raise now is the user's
            self._interrupt()
        elif self._release.can_release and not progress.second_press:  # a second press: release now
            progress.second_press = True
            if progress.released_at is None:  # else released already, after a rank's error: under way
                self._release.release("the stop button was pressed")
        else:  # and then: do not wait any longer
            self._recover("the ranks did not return after a second interrupt")

    def _handle(self, event: EventMessage) -> None:
        progress = self.progress
        if isinstance(event, RankExited):
            self._merger.flush()
            note = self._recover_pool(self.pool.spec, f"rank {event.rank} died")
            raise RankError([(event.rank, rank_exit_error(event))], self.pool.world_size, notes=(note,))
        if getattr(event, "cell_id", self.cell_id) not in self._own_cell_ids:
            return  # late output of an earlier, abandoned request
        if not isinstance(event, (CellFinished, RankActivity)):
            progress.last_output_at = time.monotonic()
        if isinstance(event, StreamOutput):
            self._merger.feed(event.rank, event.stream, event.text)
        elif isinstance(event, RichOutput):
            if event.kind == "result":  # shown once the cell ends, alike values once
                progress.results.append((event.rank, event))
            else:
                show_display(event, self._merger, self.pool.world_size)
        elif isinstance(event, TaskProgress):
            self._show_task_progress(event)
        elif isinstance(event, RankActivity):
            self._note_activity(event)
            self._show_waiting_line()
        elif isinstance(event, InputRequested):
            self._prompts.add(event)
        elif isinstance(event, CellFinished):
            self._rank_finished(event)

    def _note_activity(self, event: RankActivity) -> None:
        progress = self.progress
        before = progress.activity.get(event.rank)
        entered_another = progress.collective_counts.note(event)
        if event.collective is None:
            progress.collective_since.pop(event.rank, None)
        elif (before is None or entered_another
              or (before.collective, before.where) != (event.collective, event.where)):
            progress.collective_since[event.rank] = time.monotonic()
        progress.activity[event.rank] = event
        progress.activity_at[event.rank] = time.monotonic()
        if event.where:
            progress.last_line[event.rank] = event.where

    def _show_task_progress(self, event: TaskProgress) -> None:
        if self.progress.task_bar is None:
            from fsdp2nb.frontend.progress_bar import CellTaskBar

            self._merger.flush()  # what the ranks printed before the work began comes first
            self.progress.task_bar = CellTaskBar(self.pool.world_size)
        self.progress.task_bar.update(event)

    def _rank_finished(self, event: CellFinished) -> None:
        progress = self.progress
        progress.finished[event.rank] = event
        progress.prompts.pop(event.rank, None)
        self._merger.rank_done(event.rank)
        if event.error is not None:
            progress.errors.append((event.rank, event.error))
            if progress.first_error_at is None and self._release.can_release:
                self._ask_running_ranks()  # where they wait, for the line that says they were released
                progress.asked_after_error_at = time.monotonic()
            progress.first_error_at = progress.first_error_at or time.monotonic()
        if self._on_rank_finished is not None:
            self._on_rank_finished(event.rank, event.error is not None)

    # --- deadlines and quiet ranks --------------------------------------------------------------

    def _enforce_deadlines(self) -> None:
        """A rank failed while others go on: release the collectives they wait in (or, where groups
        cannot be re-formed, interrupt them); ranks that do not return then get a new pool."""
        progress = self.progress
        if not progress.running:  # the last rank returned in this very pass
            return
        if self._release.can_release:
            self._ask_again_after_error()
            self._release.when_due()
            if progress.released_at is not None:
                if time.monotonic() - progress.released_at > INTERRUPT_GRACE_S:
                    stuck = ", ".join(map(str, progress.running))
                    self._recover(f"rank(s) {stuck} did not return within {INTERRUPT_GRACE_S:g} s of releasing "
                                  "their collectives: they are inside code that is not a collective")
                return
        now = time.monotonic()
        if progress.interrupted_at is None and progress.first_error_at is not None:
            if now - progress.first_error_at > ERROR_GRACE_S:
                progress.interrupted_after_error = True
                self._interrupt()
        elif progress.interrupted_at is not None and now - progress.interrupted_at > INTERRUPT_GRACE_S:
            stuck = ", ".join(map(str, progress.running))
            self._recover(f"rank(s) {stuck} did not return within {INTERRUPT_GRACE_S:g} s of the interrupt")

    def _ask_again_after_error(self) -> None:
        progress = self.progress
        if progress.first_error_at is None or progress.released_at is not None or progress.interrupted_at is not None:
            return
        if time.monotonic() - progress.asked_after_error_at >= _ASK_AFTER_ERROR_S:
            progress.asked_after_error_at = time.monotonic()
            self._ask_running_ranks()

    def _interrupt(self) -> None:
        self.progress.interrupted_at = time.monotonic()
        for rank in self.progress.running:
            try:
                self.pool.send(rank, Interrupt(cell_id=self._cell_ids[rank]), connect_timeout_s=0)
                # Where it was, in case it does not return: the error then names its line.
                self.pool.send(rank, ReportActivity(cell_id=self._cell_ids[rank]), connect_timeout_s=0)
            except ConnectionError:
                pass

    def _ask_running_ranks(self) -> None:
        for rank in self.progress.running:
            try:
                self.pool.send(rank, ReportActivity(cell_id=self._cell_ids[rank]), connect_timeout_s=0)
            except ConnectionError:
                pass

    def _ask_quiet_ranks(self) -> None:
        """After WAITING_REPORT_S without output, ask the running ranks where they are, now and then."""
        progress, pool = self.progress, self.pool
        now = time.monotonic()
        if now - progress.last_output_at < WAITING_REPORT_S or now - progress.activity_asked_at < _ACTIVITY_INTERVAL_S:
            return
        progress.activity_asked_at = now
        for rank in progress.running:
            if pool.rank_process_state(rank) in ("", "zombie"):  # ended, and no agent told (it is stopped)
                self._after_unreachable_rank(ConnectionError(f"rank {rank}'s process ended and nothing reported it"),
                                             rank)
        for rank in progress.running:
            try:
                pool.send(rank, ReportActivity(cell_id=self._cell_ids[rank]), connect_timeout_s=0)
            except ConnectionError:
                pass

    def _show_waiting_line(self) -> None:
        """Shown while ranks wait: some finished while others go on, a rank is stopped or waits for
        input, or a rank sits in a collective without progress while another is elsewhere (ranks
        left out by `--ranks` included). Ranks computing quietly, a loop of collectives however
        uneven the ranks' speed, or all in the same collective show nothing."""
        progress, pool = self.progress, self.pool
        running = progress.running
        if not running:
            return
        progress.stopped = {rank: pool.ranks[rank].pid for rank in running if rank not in progress.activity
                            and rank in pool.ranks and pool.rank_process_state(rank) == "stopped"}
        if not self._ranks_wait():
            return
        now = time.monotonic()
        if progress.waiting_line is None:
            self._merger.flush()  # what the ranks printed comes before the line
            progress.waiting_line = WaitingLine(pool.world_size)
        timeout_s = pool.spec.collective_timeout_s
        time_left = {rank: timeout_s - (now - since) for rank, since in progress.collective_since.items()}
        progress.waiting_line.show(now - progress.started_at, progress.ranks, progress.activity,
                                   finished=set(progress.finished), timeout_s=timeout_s, stopped=progress.stopped,
                                   waiting_for_input=set(progress.prompts), time_left=time_left)

    def _ranks_wait(self) -> bool:
        """Read from the ranks' counts of collectives where they count them (frontend/waiting_ranks.py).
        Else from positions, once they diverged in two samples: one sample can catch the ranks of
        a healthy loop at different points."""
        progress, world_size = self.progress, self.pool.world_size
        if not (progress.finished or progress.stopped or progress.prompts):
            waits = rank_waits(progress.running, progress.activity, progress.collective_counts,
                               all_ranks_run=len(progress.ranks) == world_size)
            if waits is not None:
                return waits
        if not ranks_diverge(progress, world_size):
            progress.diverged_at = None
            return False
        now = time.monotonic()
        progress.diverged_at = progress.diverged_at or now
        return (progress.waiting_line is not None or bool(progress.stopped) or bool(progress.prompts)
                or now - progress.diverged_at >= _ACTIVITY_INTERVAL_S)

    def _show_waiting_line_now(self) -> None:
        """The waiting line at once, without a second sample (a prompt is about to block this thread)."""
        progress = self.progress
        progress.diverged_at = progress.diverged_at or time.monotonic() - _ACTIVITY_INTERVAL_S
        self._show_waiting_line()

    # --- ranks dead or stuck ----------------------------------------------------------------------

    def _recover(self, why: str) -> None:
        """Replace a pool whose ranks are stuck, then end the request saying that state was lost."""
        self._merger.flush()
        progress = self.progress
        not_returned = [(rank, self._not_returned(rank)) for rank in progress.running]
        stopped = [str(rank) for rank, error in not_returned if error.ename == "RankStopped"]
        stuck = [str(rank) for rank, error in not_returned if error.ename != "RankStopped"]
        what = "; ".join(f"{kind}: rank(s) {', '.join(ranks)}" for kind, ranks in
                         (("stopped", stopped), ("stuck", stuck)) if ranks)
        note = self._recover_pool(self.pool.spec, f"{why} ({what})")
        raise RankError(progress.errors + not_returned, self.pool.world_size, notes=(note,))

    def _not_returned(self, rank: int) -> ErrorInfo:
        """What to say of a rank that did not return: stopped by a signal, or stuck at a line."""
        info = self.pool.ranks.get(rank)
        if self.pool.rank_process_state(rank) == "stopped":
            pid = info.pid if info else "?"
            return ErrorInfo("RankStopped", f"is stopped by a signal (SIGSTOP or SIGTSTP) and cannot run; "
                                            f"`kill -CONT {pid}` would have resumed it", ())
        activity = self.progress.activity.get(rank)
        where = f" (at {activity.where})" if activity is not None and activity.where else ""
        return ErrorInfo("RankStuck", f"did not return after the interrupt{where}: it ignored it or "
                                      "is inside code that cannot be interrupted", ())

    def _after_agent_death(self) -> None:
        """The host agent died mid-request; its ranks died with it: end the request, start afresh."""
        self._merger.flush()
        reason = self.pool.broken_reason or "the host agent died"
        errors = [(rank, ErrorInfo("RankDied", f"ended with its host agent: {reason}", ()))
                  for rank in self.progress.running]
        note = self._recover_pool(self.pool.spec, reason)
        raise RankError(self.progress.errors + errors, self.pool.world_size, notes=(note,))

    def _after_unreachable_rank(self, error: ConnectionError, rank: int | None = None) -> None:
        """A rank could not be reached: its process is gone. Its cause wins over the broken pipe
        whatever the order they are seen in: a dead agent ends the request as such, a rank's exit
        report as that rank's death."""
        pool = self.pool
        if pool.wait_for_exit_cause(EXIT_CAUSE_GRACE_S):
            if not pool.check_agent():
                self._after_agent_death()
            if pool.exited:
                self._handle(next(iter(pool.exited.values())))
        reason = pool.broken_reason or str(error)
        note = self._recover_pool(pool.spec, f"the cell could not reach its ranks ({reason})")
        first = self.progress.ranks[0] if rank is None else rank
        raise RankError([(first, ErrorInfo("RankDied", f"could not be reached: {reason}", ()))],
                        pool.world_size, notes=(note,))
