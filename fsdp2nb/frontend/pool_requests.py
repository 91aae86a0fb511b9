"""Running work on the session's pool: each request to the ranks, from its send to their replies.

The session (frontend/session.py) starts, replaces and lets go of pools; `PoolRequests` runs
work on whichever pool it is handed, as ipyparallel keeps a View apart from its Client: cells
(blocking, sent ahead of the magic, or `--bg`), push, pull, post-mortems, the re-forming of
process groups after a failed collective, and the run a kernel takes over when it attaches.
Where ranks are dead or stuck, the session's `recover` replaces the pool.

Blocking requests are waited for on the kernel's main thread, so the stop button (SIGINT ->
KeyboardInterrupt) lands here and is turned into an interrupt of every rank still running.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from fsdp2nb.errors import InvalidValue, NothingToDebug, RankError
from fsdp2nb.frontend.background import (
    BackgroundRun,
    BackgroundRuns,
    requests_at_attach,
    resume_background_run,
    start_background_run,
    taken_over_run,
)
from fsdp2nb.frontend.cell_progress import CellProgress
from fsdp2nb.frontend.cell_transform import notebook_execution_count, transform_and_check
from fsdp2nb.frontend.notebook_input import PromptRelay, ask_notebook, refuse_in_background
from fsdp2nb.frontend.output import notebook_color_scheme
from fsdp2nb.frontend.rank_prompts import AskInput
from fsdp2nb.frontend.released_collectives import GroupsNotReformed
from fsdp2nb.frontend.request_wait import Recover, RequestWait, StopPresses
from fsdp2nb.host.sigint import drop_late_presses, sigint_noted
from fsdp2nb.pool.handle import PoolHandle
from fsdp2nb.wire.events import CellFinished
from fsdp2nb.wire.requests import (
    ControlMessage,
    PostMortem,
    PullValue,
    PushValues,
    ReformGroups,
    RunCell,
    RunCommand,
)


@dataclass(frozen=True, slots=True)
class SentCell:
    """A cell sent to the ranks whose replies are still to be waited for (`finish_cell`)."""

    wait: RequestWait
    stop_button: contextlib.ExitStack
    """Holds the stop button's noting (`sigint_noted`) from the send until the wait ends."""


class PoolRequests:
    """Sends requests to a pool's ranks and waits for their replies; the session holds one."""

    def __init__(self, recover: Recover) -> None:
        self._recover = recover
        """Replaces a pool whose ranks are dead or stuck (the session's restart); returns the note."""
        self._cell_ids = itertools.count(1)
        self.background = BackgroundRuns()
        """Background runs (`%%fsdp2 --bg`); see frontend/background.py."""
        self.last_failed_rank: int | None = None
        """The rank whose error came first in the last failed cell: `%fsdp2 debug` opens it."""

    # --- cells ----------------------------------------------------------------------------------

    def run_cell(self, pool: PoolHandle, code: str, ranks: tuple[int, ...], *, profile: bool = False) -> None:
        """Run `code` on `ranks`, streaming output; raises RankError if any rank raised.
        `profile`: under torch.profiler on each rank (`%%fsdp2 --profile`)."""
        self.finish_cell(self.send_cell(pool, code, ranks, notebook_execution_count(), profile=profile))

    def send_cell(self, pool: PoolHandle, code: str, ranks: tuple[int, ...],
                  execution_count: int | None, *, profile: bool = False) -> SentCell:
        """Send `code` to `ranks` and return at once; `finish_cell` waits for the replies. The cell
        is transformed and checked first (CellSyntaxError: nothing sent). From the send until
        `finish_cell` ends, the stop button only takes note, as in `run_request`."""
        make_request = _cell_request(code, execution_count, profile)
        stop_button = contextlib.ExitStack()
        presses = stop_button.enter_context(sigint_noted())
        try:
            wait = self.request_wait(pool, ranks, stop_presses=presses)
            wait.send(make_request(wait.cell_id))
        except BaseException:
            stop_button.close()
            raise
        return SentCell(wait=wait, stop_button=stop_button)

    def finish_cell(self, sent: SentCell) -> None:
        """Wait for the replies to a cell `send_cell` sent, streaming output; raises RankError if
        any rank raised. Must follow its `send_cell` on the same (main) thread."""
        with sent.stop_button:
            try:
                sent.wait.wait_for_replies()
            except RankError as error:
                self.last_failed_rank = error.errors[0][0]  # the root cause: reported first
                raise
            finally:
                if sent.wait.progress.stopped_by_user:
                    drop_late_presses()  # a double press: its second half may come after the end

    def run_in_background(self, pool: PoolHandle, code: str, ranks: tuple[int, ...],
                          name: str | None) -> BackgroundRun:
        """`%%fsdp2 --bg`: send `code` to `ranks` and return the run's handle at once; a runner
        thread waits for the replies (frontend/background.py)."""
        count = notebook_execution_count()
        make_request = _cell_request(code, count)
        run = BackgroundRun(ranks=ranks, execution_count=count, name=name)
        wait = self.request_wait(pool, ranks, ask_input=refuse_in_background, stop_presses=run.stops,
                                 on_rank_finished=run.rank_finished)
        start_background_run(self.background, wait, make_request(wait.cell_id), run)
        pool.note_background_run(wait.cell_id, count, name)
        return run

    def take_over(self, pool: PoolHandle) -> BackgroundRun | None:
        """Just attached to a kept pool: request ids go on after those its ranks ran, and what they
        run now (a `--bg` run or a cell of a kernel that was lost) becomes one handle that waits
        here for all of it; its prompts are asked in the cell that waits for it (PromptRelay)."""
        self._cell_ids = itertools.count(max((slot.last_cell_id for slot in pool.work_at_attach), default=0) + 1)
        cell_ids = requests_at_attach(pool)
        if not cell_ids:
            return None
        relay = PromptRelay()
        run, busy_since = taken_over_run(pool, cell_ids, relay)
        wait = RequestWait(pool, min(cell_ids.values()), run.ranks, cell_ids=cell_ids,
                           recover=self._recover, ask_input=relay.ask,
                           before_prompt=relay.can_answer, stop_presses=run.stops,
                           on_rank_finished=run.rank_finished, started_at=run.started_at,
                           reform=lambda release_id: self._reform_groups(pool, release_id))
        resume_background_run(self.background, wait, run, busy_since)
        return run

    # --- other requests -------------------------------------------------------------------------

    def debug(self, pool: PoolHandle, rank: int | None) -> None:
        """A post-mortem of the last failed cell on `rank` (default: the rank whose error came first)."""
        rank = self.last_failed_rank if rank is None else rank
        if rank is None:
            raise NothingToDebug("no %%fsdp2 cell has failed yet, so there is nothing to debug; "
                                 "`%fsdp2 debug --rank R` opens the last error of rank R")
        if rank not in range(pool.world_size):
            raise InvalidValue(f"--rank {rank} is not a rank of this pool (ranks 0-{pool.world_size - 1})")
        self.run_request(pool, (rank,), lambda cell_id: PostMortem(cell_id=cell_id))

    def push(self, pool: PoolHandle, payload: bytes) -> None:
        self.run_request(pool, tuple(range(pool.world_size)),
                         lambda cell_id: PushValues(cell_id=cell_id, payload=payload))

    def pull(self, pool: PoolHandle, name: str, reply_ranks: tuple[int, ...]) -> dict[int, bytes]:
        progress = self.run_request(pool, tuple(range(pool.world_size)),
                                    lambda cell_id: PullValue(cell_id=cell_id, name=name, reply_ranks=reply_ranks))
        return {rank: _pulled(progress.finished[rank]) for rank in reply_ranks}

    # --- any request ----------------------------------------------------------------------------

    def next_cell_id(self) -> int:
        """A fresh request id (itertools.count: atomic, so any thread may take one)."""
        return next(self._cell_ids)

    def request_wait(self, pool: PoolHandle, ranks: tuple[int, ...], *, ask_input: AskInput = ask_notebook,
                     stop_presses: StopPresses | None = None,
                     on_rank_finished: Callable[[int, bool], None] | None = None) -> RequestWait:
        """The wait for one request to `ranks`, with a fresh id; recovery restarts the session's pool."""
        return RequestWait(pool, self.next_cell_id(), ranks, recover=self._recover,
                           ask_input=ask_input, stop_presses=stop_presses, on_rank_finished=on_rank_finished,
                           reform=lambda release_id: self._reform_groups(pool, release_id))

    def run_request(self, pool: PoolHandle, ranks: tuple[int, ...],
                    make_request: Callable[[int], ControlMessage]) -> CellProgress:
        """Send a request to `ranks` and wait for their replies on this (the kernel's main) thread."""
        # The stop button only takes note while a request is sent and waited for: sent to all
        # ranks or none, and never between an event taken off the queue and its recording.
        with sigint_noted() as stop_button:
            wait = self.request_wait(pool, ranks, stop_presses=stop_button)
            wait.send(make_request(wait.cell_id))  # sent first: what follows runs while the ranks wake up
            return wait.wait_for_replies()

    def _reform_groups(self, pool: PoolHandle, release_id: int | None) -> str:
        """After a released (`release_id`) or failed collective: every rank connects its process
        groups afresh and reshards the FSDP2 modules whose iteration failed. The note to show; if
        the ranks cannot re-form, the pool is restarted and the note says what was lost."""
        started = time.monotonic()
        ranks = tuple(sorted(pool.ranks))
        wait = RequestWait(pool, self.next_cell_id(), ranks, recover=self._recover,
                           ask_input=refuse_in_background)
        reform = ReformGroups(generation=secrets.randbits(62), after_release=release_id)
        wait.send(RunCommand(cell_id=wait.cell_id, command=reform))
        try:
            wait.wait_for_replies()
        except RankError as error:
            if error.notes:  # the pool was restarted meanwhile: its note says so
                raise GroupsNotReformed("\n".join(error.notes)) from error
            raise GroupsNotReformed(self._recover(
                pool.spec, f"the process groups could not be re-formed ({error})")) from error
        return (f"the process groups were re-formed in place in {time.monotonic() - started:.2f} s: every rank's "
                "variables, model and optimizer state are kept")


def _pulled(reply: CellFinished) -> bytes:
    assert reply.value is not None, "a rank asked for a value replies with it, or fails"
    return reply.value


def _cell_request(code: str, execution_count: int | None, profile: bool = False) -> Callable[[int], RunCell]:
    """The request that runs a notebook cell, for the request id a wait takes; the cell is
    transformed here, once (a SyntaxError is raised before anything is sent)."""
    transformed = transform_and_check(code)
    scheme = notebook_color_scheme()
    return lambda cell_id: RunCell(cell_id=cell_id, code=code, transformed=transformed,
                                   execution_count=execution_count, color_scheme=scheme, profile=profile)
