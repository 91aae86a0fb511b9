"""Ranks left in collectives that cannot complete: when the wait releases them, and what the cell
says afterwards.

A rank that failed, the stop button, or collectives that do not match (ranks in different ones,
or some ranks finished while others wait) leave ranks blocked until the collective timeout. The
wait (`frontend/request_wait.py`) asks `CollectiveRelease.when_due` on every pass; it sends
`ReleaseCollectives` to every rank, whose blocked collectives then fail at once. Once every rank
has replied, `outcome` re-forms the process groups in place (`Reform`, every rank's state kept)
and gives the errors to show, root causes first, and the notes under them. Pools whose groups
cannot be re-formed (NCCL for now) are never released: their ranks are interrupted instead, and
a failed collective marks the pool broken.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp2nb.errors import Fsdp2nbError
from fsdp2nb.frontend.errors import alarm
from fsdp2nb.wire.records import ErrorInfo
from fsdp2nb.wire.requests import ReleaseCollectives

if TYPE_CHECKING:
    from fsdp2nb.frontend.cell_progress import CellProgress
    from fsdp2nb.pool.handle import PoolHandle

RELEASE_AFTER_INTERRUPT_S = 0.5
"""After the stop button, how long ranks may take to return before their collectives are released
(a thread blocked in one ignores SIGINT)."""
UNMATCHED_COLLECTIVE_S = 5.0
"""How long ranks may sit in collectives that cannot complete (others wait in another one, or the
cell runs on some ranks only) before the collectives are released."""
FINISHED_WHILE_WAITING_S = 20.0
"""How long ranks may wait in a collective after others finished the cell before it is released:
longer, since under load a barrier's last message can reach a rank seconds after its peers left."""

Reform = Callable[[int | None], str]
"""Re-forms the process groups of every rank after a released or failed collective, given the id
of the release sent (None if none was); returns the note to show. If that fails it restarts the
pool and raises GroupsNotReformed with the note."""


class GroupsNotReformed(Fsdp2nbError):
    """The process groups could not be re-formed, so the pool was restarted: the cell fails."""


class CollectiveRelease:
    """Releases one request's ranks from their collectives when due, and says what happened."""

    def __init__(self, progress: CellProgress, pool: PoolHandle, cell_ids: dict[int, int], cell_id: int,
                 reform: Reform | None) -> None:
        """`reform`: None where the pool's groups cannot be re-formed (nothing is released)."""
        self._progress = progress
        self._pool = pool
        self._cell_ids = cell_ids
        self._cell_id = cell_id
        self._reform = reform
        self._release_id: int | None = None

    @property
    def can_release(self) -> bool:
        return self._reform is not None

    def when_due(self) -> None:
        """Release at once when a rank is seen in a collective after another failed (it can only
        wait for it), shortly after the stop button or the interrupt that follows a failure, and
        when ranks sit in collectives that cannot complete. Ranks still computing after a failure
        are not released (that would only fail their next collective): they are interrupted."""
        progress = self._progress
        if progress.released_at is not None:
            return
        if progress.first_error_at is not None:
            waiting = any(progress.activity_at.get(rank, 0.0) > progress.first_error_at
                          and progress.activity[rank].collective for rank in progress.running)
            if waiting or self._interrupted_for(RELEASE_AFTER_INTERRUPT_S):
                cause = ("the cell was interrupted" if progress.interrupted_at is not None
                         else f"rank {progress.errors[0][0]} failed while they waited")
                self.release(cause)
        elif self._interrupted_for(RELEASE_AFTER_INTERRUPT_S):
            self.release("the cell was interrupted")
        elif (unmatched := unmatched_collectives(progress, self._pool.world_size)) is not None:
            self.release(unmatched)

    def _interrupted_for(self, seconds: float) -> bool:
        interrupted_at = self._progress.interrupted_at
        return interrupted_at is not None and time.monotonic() - interrupted_at > seconds

    def release(self, cause: str) -> None:
        """Cut every rank's collectives: ranks blocked in one return with an error at once, the
        others fail at their next. The groups are re-formed once every rank has replied."""
        progress = self._progress
        progress.released_at = time.monotonic()
        progress.release_cause = cause
        progress.released_from = {rank: activity.collective for rank, activity in progress.activity.items()
                                  if activity.collective and rank in progress.running}
        self._release_id = secrets.randbits(62)
        for rank in sorted(self._pool.ranks):
            try:
                self._pool.send(rank, ReleaseCollectives(cell_id=self._cell_ids.get(rank, self._cell_id),
                                                         release_id=self._release_id), connect_timeout_s=0)
            except ConnectionError:
                pass  # its end is reported as an exit of its own

    def outcome(self) -> tuple[list[tuple[int, ErrorInfo]], tuple[str, ...]]:
        """The errors to show, root causes first, and the notes under them. After a released or
        failed collective the process groups are re-formed in place (every rank's state kept);
        a pool whose groups cannot be re-formed is marked broken instead."""
        progress = self._progress
        all_errors, interrupted_notes = self._interrupts_as_notes()
        failed = sorted(rank for rank, error in all_errors if error.kind in ("collective", "released"))
        if progress.released_at is None and not failed:
            return all_errors, interrupted_notes
        causes = [(rank, error) for rank, error in all_errors if error.kind != "released"]
        released = sorted(rank for rank, error in all_errors if error.kind == "released")
        if self._reform is None:
            ranks = ", ".join(map(str, failed))
            self._pool.mark_broken(f"a collective failed on rank(s) {ranks}")
            return progress.errors, (alarm(f"a collective failed on rank(s) {ranks}: the pool's process group is "
                                           "unusable now") + "\n`%fsdp2 restart` starts a fresh pool (rank state "
                                     "is lost); `--timeout SECONDS` there sets the collective timeout",)
        errors = causes or [(rank, self._released_error(rank)) for rank in released]
        notes = (*interrupted_notes, self._released_line(released)) if released else interrupted_notes
        try:
            return errors, (*notes, self._reform(self._release_id))
        except GroupsNotReformed as restarted:  # state is lost: never a cell that looks fine
            lost = ErrorInfo("GroupsNotReformed", "the process groups could not be re-formed", (), kind="collective")
            return errors or [(progress.ranks[0], lost)], (*notes, str(restarted))

    def _interrupts_as_notes(self) -> tuple[list[tuple[int, ErrorInfo]], tuple[str, ...]]:
        """Ranks interrupted because another failed (not by the stop button) raised only the
        KeyboardInterrupt they were sent: one line says where they were, under the real errors."""
        progress = self._progress
        if not progress.interrupted_after_error or not self.can_release:  # NCCL: a rank pulled out of a wait says so
            return progress.errors, ()
        interrupted = [rank for rank, error in progress.errors if _only_interrupted(error)]
        others = [(rank, error) for rank, error in progress.errors if rank not in interrupted]
        if not interrupted or not others:
            return progress.errors, ()
        where = [f"rank {rank} at {progress.last_line[rank]}" for rank in interrupted if rank in progress.last_line]
        cause = f"rank {others[0][0]} failed while they went on"
        return others, (f"interrupted rank(s) {', '.join(map(str, interrupted))}: {cause}"
                        + (f" ({'; '.join(where)})" if where else ""),)

    def _released_line(self, released: list[int]) -> str:
        """One line for the ranks whose collectives were released."""
        progress = self._progress
        where = sorted({progress.released_from[rank] for rank in released if rank in progress.released_from})
        collectives = f" from {', '.join(where)}" if where else ""
        cause = f" ({progress.release_cause})" if progress.release_cause else ""
        return (f"released rank(s) {', '.join(map(str, released))}{collectives}: "
                f"their collectives could not complete{cause}")

    def _released_error(self, rank: int) -> ErrorInfo:
        """A released rank's error where no rank raised (collectives that did not match)."""
        collective = self._progress.released_from.get(rank, "a collective")
        return ErrorInfo("CollectiveReleased", f"waited in {collective}, which could not complete", (),
                         kind="released")


def _only_interrupted(error: ErrorInfo) -> bool:
    """A KeyboardInterrupt raised in the rank's own code, not while a collective was released."""
    return error.ename == "KeyboardInterrupt" and error.kind not in ("released", "collective")


def unmatched_collectives(progress: CellProgress, world_size: int) -> str | None:
    """Why the running ranks' collectives cannot complete, once each has sat in the same one for
    UNMATCHED_COLLECTIVE_S while others finished, or waited in another collective; else None."""
    running = progress.running
    if not running or progress.prompts or progress.stopped:
        return None
    now = time.monotonic()
    wait_s = FINISHED_WHILE_WAITING_S if progress.finished else UNMATCHED_COLLECTIVE_S
    if any(now - progress.collective_since.get(rank, now) < wait_s for rank in running):
        return None  # some rank is not in a collective, or has not been in it for long
    waits = {rank: progress.activity[rank] for rank in running}
    if progress.finished:
        done = ", ".join(map(str, sorted(progress.finished)))
        return f"rank(s) {done} finished the cell while the others waited in a collective"
    if len({activity.collective for activity in waits.values()}) > 1:
        return "collectives did not match: " + "; ".join(
            f"rank {rank} in {activity.collective}" + (f" at {activity.where}" if activity.where else "")
            for rank, activity in sorted(waits.items()))
    if len(progress.ranks) < world_size:
        return "the cell runs on some ranks only, and they wait in a collective of every rank"
    return None


def ranks_diverge(progress: CellProgress, world_size: int) -> bool:
    """Whether the ranks are where a collective not every rank entered leaves them."""
    if progress.finished or progress.stopped or progress.prompts:
        return True
    sampled = [progress.activity.get(rank) for rank in progress.running]
    # A rank in a loop of collectives is sometimes caught on the collective's line but between two
    # calls: it stands where the ranks in that collective stand.
    on_line = {activity.where: activity.collective for activity in sampled if activity and activity.collective}
    collectives = {(activity.collective or on_line.get(activity.where)) if activity else None for activity in sampled}
    if collectives == {None}:
        return False
    return len(collectives) > 1 or len(progress.ranks) < world_size
