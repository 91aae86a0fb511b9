"""The notebook side of a pool: its lifecycle, and running a request on the ranks until they reply.

One `NotebookSession` lives in the kernel per loaded extension. It owns at most one pool, and
every magic is one call into it. Waiting for the ranks happens on the kernel's main thread, so
the stop button (SIGINT -> KeyboardInterrupt) lands here and is turned into an interrupt of
every rank that is still running.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp2nb.errors import (
    AttachFailed,
    BackgroundRunActive,
    InvalidValue,
    KeepRefused,
    NoPoolRunning,
    NoSuchPool,
    NothingToDebug,
    PoolAlreadyRunning,
    PoolBroken,
    PoolHeldError,
    PoolMismatchError,
    PoolNameNeeded,
    PoolNotKept,
    PoolStartError,
    RankError,
    UsageMistake,
)
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
from fsdp2nb.frontend.errors import alarm
from fsdp2nb.frontend.notebook_input import PromptRelay, ask_notebook, refuse_in_background
from fsdp2nb.frontend.output import notebook_color_scheme, write_to_kernel
from fsdp2nb.frontend.rank_prompts import AskInput
from fsdp2nb.frontend.released_collectives import GroupsNotReformed
from fsdp2nb.frontend.request_wait import RequestWait, StopPresses
from fsdp2nb.pool.handle import BusyListener, PoolHandle, SnapshotListener
from fsdp2nb.pool.kept import KeepOptions
from fsdp2nb.pool.kept_listing import list_pools
from fsdp2nb.pool.launcher import LocalLauncher, describe_exit
from fsdp2nb.pool.pool import WorkerPool
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire import memory_store
from fsdp2nb.wire.process_identity import own_process_key
from fsdp2nb.wire.protocol import (
    CellFinished,
    ControlMessage,
    PostMortem,
    PullValue,
    PushValues,
    ReformGroups,
    RunCell,
    RunCommand,
)
from fsdp2nb.wire.sigint import drop_late_presses, sigint_noted

if TYPE_CHECKING:
    from fsdp2nb.frontend.dashboard_link import DashboardLink

logger = logging.getLogger(__name__)

RESUME_HINT = ("to resume, run the cells that set up the ranks again (model, optimizer, Checkpointer); "
               "`ckpt.load(\"latest\")` then continues from the last checkpoint saved")
RESTORE_HINT = ("run the cells that set up the ranks again (model, optimizer, Checkpointer on the same "
                "directory): `track()` restores it")


@dataclass(frozen=True, slots=True)
class SentCell:
    """A cell sent to the ranks whose replies are still to be waited for (`finish_cell`)."""

    wait: RequestWait
    stop_button: contextlib.ExitStack
    """Holds the stop button's noting (`sigint_noted`) from the send until the wait ends."""


class NotebookSession:
    """Owns the pool of one kernel; the magics call its methods."""

    def __init__(self, pool_factory: Callable[[PoolSpec], PoolHandle] | None = None) -> None:
        self.pool: PoolHandle | None = None
        self.launcher: LocalLauncher | None = None
        """Starts this session's pools, and keeps a standby agent for the next (None where
        `pool_factory` was given: that factory launches its own)."""
        if pool_factory is None:
            self.launcher = LocalLauncher()
            pool_factory = self._pool_with_standby
        self._pool_factory = pool_factory
        self._cell_ids = itertools.count(1)
        self.background = BackgroundRuns()
        """Background runs (`%%fsdp2 --bg`); see frontend/background.py."""
        self.last_failed_rank: int | None = None
        """The rank whose error came first in the last failed cell: `%fsdp2 debug` opens it."""
        self.lifecycle_lock = threading.RLock()
        """Held while the pool is started, stopped or replaced: the dashboard's Restart runs on a
        subshell thread, and a cell started meanwhile must get the new pool, not a half-stopped one."""
        self.snapshot_listeners: list[SnapshotListener] = []
        """Called on the thread reading a pool's events with its snapshots and progress events. Every pool
        this session starts or attaches is given this list itself, so a listener is added once
        (`add_snapshot_listener`) and hears the running pool and every later one from its start."""
        self.busy_listeners: list[BusyListener] = []
        """Called when a request to a pool's ranks starts or ends; shared with every pool as above."""
        self._listeners_lock = threading.Lock()
        self.memory_dir = ""
        """The snapshot store of this session's pools (wire/memory_store.py), made with the first
        pool and kept across restarts; removed by `stop()` (and the kernel's exit)."""
        self.dashboard: DashboardLink | None = None
        """The dashboard's link to this session's pools, once one was asked for (`dashboard_link`)."""
        self._dashboard_lock = threading.Lock()

    def dashboard_link(self) -> DashboardLink:
        """The session's dashboard link, made on first use (its thread starts then): one, whichever
        threads ask. Imported only then: a notebook that shows no dashboard loads none of it."""
        with self._dashboard_lock:
            if self.dashboard is None:
                from fsdp2nb.frontend.dashboard_link import DashboardLink

                self.dashboard = DashboardLink(self)
            return self.dashboard

    def add_snapshot_listener(self, listener: SnapshotListener) -> None:
        """Have `listener` hear every snapshot of this session's pools; a second add is no second call."""
        with self._listeners_lock:  # threads may ask at once: the dashboard's, a click's, the main one
            if listener not in self.snapshot_listeners:
                self.snapshot_listeners.append(listener)

    def add_busy_listener(self, listener: BusyListener) -> None:
        """Have `listener` called whenever a request to this session's pools starts or ends."""
        with self._listeners_lock:
            if listener not in self.busy_listeners:
                self.busy_listeners.append(listener)

    def _share_listeners(self, pool: PoolHandle) -> None:
        pool.snapshot_listeners = self.snapshot_listeners  # the same list: see `snapshot_listeners`
        pool.busy_listeners = self.busy_listeners

    # --- pool lifecycle -----------------------------------------------------------------------

    def _pool_with_standby(self, spec: PoolSpec) -> PoolHandle:
        """A pool on this host launches through the session's launcher (and its standby agent);
        one across hosts through the engine its spec names."""
        return WorkerPool(spec, launcher=self.launcher if spec.placement is None else None,
                          memory_dir=self._memory_store())

    def _memory_store(self) -> str:
        if not self.memory_dir:
            self.memory_dir = str(memory_store.session_store(*own_process_key()))
        return self.memory_dir

    def start(self, spec: PoolSpec, keep: KeepOptions | None = None) -> PoolHandle:
        with self.lifecycle_lock:
            return self._start(spec, keep)

    def _start(self, spec: PoolSpec, keep: KeepOptions | None = None) -> PoolHandle:
        if self.pool is not None and self.pool.state in ("ready", "starting"):
            raise PoolAlreadyRunning(
                 f"a pool ({self.pool.spec.describe()}) is already running; `%fsdp2 restart` replaces it")
        if keep is not None:
            check_keepable(spec)
        self.stop(keep_standby=True)
        if spec.placement is not None and self.launcher is not None:
            self.launcher.close()  # pools across hosts start their agents elsewhere: it would only wait
        started = time.perf_counter()
        if keep is None:
            pool = self._pool_factory(spec)
        elif self.launcher is not None:  # across hosts the spec's engine launches (launcher_for)
            pool = WorkerPool(spec, launcher=self.launcher if spec.placement is None else None, keep=keep)
        else:
            raise KeepRefused("--keep needs the session's own launcher (this session was given a pool factory)")
        self._share_listeners(pool)  # before it starts: the first snapshots are heard too
        pool.start()
        self.pool = pool
        for note in pool.start_notes:
            print(note, file=sys.stderr)
        logger.info("started %d ranks in %.1f s", spec.world_size, time.perf_counter() - started)
        if self.launcher is not None and spec.placement is None:
            self.launcher.start_standby()  # the next restart forks from it (see pool/launcher.py)
        return pool

    def prepare_first_start(self) -> None:
        """Start the first pool's host agent now, while the kernel waits for the user: it imports
        torch (most of a cold start) and then waits for its launch plan. Not while a pool runs,
        nor with FSDP2NB_STANDBY=0 (a kernel that may never start a pool saves the process)."""
        if self.launcher is None or self.pool is not None or os.environ.get("FSDP2NB_STANDBY") == "0":
            return
        self.launcher.start_standby()

    def release(self) -> None:
        """At the kernel's exit (or the extension's unload): let go of a kept pool, which goes on
        running; stop any other. Safe to call twice."""
        with self.lifecycle_lock:
            pool = self.pool
            if pool is not None and pool.keep is not None:
                self.pool = None
                pool.detach()
        self.stop()

    def stop(self, *, polite: bool = True, keep_standby: bool = False) -> bool:
        """Stop the pool if there is one; returns whether there was. Safe to call twice.

        `polite=False` skips asking the ranks to exit, for ranks known to be stuck or dead.
        The standby agent ends too, unless a new pool is about to start (`keep_standby`)."""
        with self.lifecycle_lock:
            pool, self.pool = self.pool, None
            if self.launcher is not None and not keep_standby:
                self.launcher.close()
            if not keep_standby:  # the pools' snapshots end with them (a restart keeps them)
                memory_store.remove_store(self.memory_dir)
        if pool is None:
            return False
        # Busy ranks (a background run at kernel exit) read no exit request until their cell ends.
        pool.stop(polite=polite and not pool.busy_ranks, keep_memory=keep_standby)
        return True

    def restart(self, spec: PoolSpec | None = None) -> PoolHandle:
        """A fresh pool; a kept one stays kept, under its name."""
        with self.lifecycle_lock:
            spec = spec or (self.pool.spec if self.pool else None)
            if spec is None:
                raise NoPoolRunning("no pool to restart; start one with `%fsdp2 start --cpu N` or `--gpus N`")
            keep = self.check_held()
            self.stop(keep_standby=True)
            return self._start(spec, keep)

    def check_held(self) -> KeepOptions | None:
        """The running pool's keep options; PoolHeldError (and this kernel lets go) if another
        kernel took it."""
        pool = self.pool
        if pool is None or pool.keep is None:
            return None
        if not pool.held_here():
            note = pool.holder_note()
            self.pool = None
            pool.release()
            raise PoolHeldError(f"kept pool {pool.keep.name!r} was taken by {note}; "
                                f"`%fsdp2 attach {pool.keep.name} --take` takes it back")
        return pool.keep

    # --- kept pools ---------------------------------------------------------------------------

    def attach(self, name: str | None, *, take: bool = False) -> tuple[PoolHandle, BackgroundRun | None]:
        """Hold the kept pool `name` (None: the only one) from this kernel; its background run,
        if one is going, gets a handle here. Raises a UsageMistake with one line, nothing changed."""
        with self.lifecycle_lock:
            if self.pool is not None and self.pool.state in ("ready", "starting", "broken"):
                if self.pool.keep is not None and self.pool.keep.name == name and self.pool.held_here():
                    raise PoolAlreadyRunning(f"this kernel holds kept pool {name!r} already")
                raise PoolAlreadyRunning(f"this kernel runs a pool already ({self.pool.spec.describe()}); "
                                         "`%fsdp2 detach` (a kept pool) or `%fsdp2 stop` first")
            name = name or _only_pool_name()
            try:
                pool = WorkerPool.attach(name, take=take)
            except PoolStartError as error:
                raise AttachFailed(f"kept pool {name!r} did not answer: {error}") from None
            self.stop(keep_standby=True)  # nothing to stop: drops a dead pool's leftovers
            self._share_listeners(pool)
            self.pool = pool
            work = pool.work_at_attach
            self._cell_ids = itertools.count(max((slot.last_cell_id for slot in work), default=0) + 1)
            return pool, self._resume_run(pool)

    def _resume_run(self, pool: PoolHandle) -> BackgroundRun | None:
        """What the ranks ran when this kernel attached (a `--bg` run or a cell of a kernel that
        was lost), as one handle that waits here for all of it; its prompts are asked in the
        cell that waits for it (PromptRelay)."""
        cell_ids = requests_at_attach(pool)
        if not cell_ids:
            return None
        relay = PromptRelay()
        run, busy_since = taken_over_run(pool, cell_ids, relay)
        wait = RequestWait(pool, min(cell_ids.values()), run.ranks, cell_ids=cell_ids,
                           recover=self._restart_after_failure, ask_input=relay.ask,
                           before_prompt=relay.can_answer, stop_presses=run.stops,
                           on_rank_finished=run.rank_finished, started_at=run.started_at,
                           reform=lambda release_id: self._reform_groups(pool, release_id))
        resume_background_run(self.background, wait, run, busy_since)
        return run

    def detach(self) -> str:
        """Let go of the kept pool: it runs on, for `%fsdp2 attach` in any kernel. Returns its name."""
        with self.lifecycle_lock:
            keep = self.check_held()
            if self.pool is None:
                raise NoPoolRunning("no pool is running, so there is nothing to detach")
            if keep is None:
                raise PoolNotKept("the running pool is not kept: it ends with this kernel "
                                  "(`%fsdp2 start --keep` starts one that outlives it)")
            active = self.background.active
            if active is not None:
                raise BackgroundRunActive(f"{active.label} runs in this kernel; `%fsdp2 wait` for it first "
                                          "(if this kernel ends instead, the run goes on in the kept pool)")
            pool, self.pool = self.pool, None
            pool.detach()
            return keep.name

    def pool_for(self, spec: PoolSpec | None, default: Callable[[], PoolSpec],
                 keep: KeepOptions | None = None) -> PoolHandle:
        """The running pool if it matches `spec` (None: any), else a new one. Never drops state silently."""
        with self.lifecycle_lock:
            return self._pool_for(spec, default, keep)

    def _pool_for(self, spec: PoolSpec | None, default: Callable[[], PoolSpec],
                  keep: KeepOptions | None = None) -> PoolHandle:
        self.check_held()
        pool = self.pool
        if pool is not None and keep is not None and pool.keep is None:
            raise PoolMismatchError("this cell asks for a kept pool but the running one is not kept; "
                                    "`%fsdp2 stop`, then start it with --keep (rank state is lost)")
        if pool is not None and (not pool.check_agent() or pool.state == "broken"):
            pool = self._replace_dead_pool(pool)
        if pool is None:
            return self._start(spec or default(), keep)
        if spec is not None and spec != pool.spec:
            raise PoolMismatchError(
                f"this cell asks for {spec.describe()} but the running pool is {pool.spec.describe()}; "
                f"`%fsdp2 restart {spec.describe()}` replaces it (rank state is lost)")
        return pool

    def _replace_dead_pool(self, pool: PoolHandle) -> PoolHandle:
        """The host agent or a rank died between cells (or the pool broke otherwise): start afresh
        and say what died and what is kept, as a death inside a cell does."""
        reason = self._broken_reason()
        note = self._restart_after_failure(pool.spec, f"{reason} while the pool was idle")
        write_to_kernel("stderr", note + "\n")
        if self.pool is None or self.pool is pool:
            raise PoolBroken(f"{reason}, and a new pool did not start; "
                             f"`%fsdp2 start {pool.spec.describe()}` tries again")
        return self.pool

    def kept_in_memory(self) -> str:
        """What the pool's snapshot store holds, as a phrase ("step 5 of /ckpt (1 MiB of host
        memory)"); empty when it holds nothing."""
        store = self.pool.memory_dir if self.pool is not None else self.memory_dir
        return " and ".join(snapshot.describe() for snapshot in memory_store.kept_snapshots(store))

    def _broken_reason(self) -> str:
        if self.pool and self.pool.broken_reason:
            return self.pool.broken_reason
        if self.pool and self.pool.exited:
            report = next(iter(self.pool.exited.values()))
            return f"rank {report.rank} exited, {describe_exit(report)}"
        return "a rank stopped answering"

    # --- requests -----------------------------------------------------------------------------

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

    def pool_ready_for_a_cell(self) -> PoolHandle | None:
        """The running pool, where a cell can go to it at once: nothing to start, replace, take
        back or wait for first (`pool_for` and the background runs do those, saying so)."""
        pool = self.pool
        if pool is None or pool.state != "ready" or pool.exited or not pool.held_here() or not pool.check_agent():
            return None
        latest = self.background.latest
        if self.background.active is not None or (latest is not None and latest.unseen_error() is not None):
            return None
        return pool

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

    def next_cell_id(self) -> int:
        """A fresh request id (itertools.count: atomic, so any thread may take one)."""
        return next(self._cell_ids)

    def request_wait(self, pool: PoolHandle, ranks: tuple[int, ...], *, ask_input: AskInput = ask_notebook,
                     stop_presses: StopPresses | None = None,
                     on_rank_finished: Callable[[int, bool], None] | None = None) -> RequestWait:
        """The wait for one request to `ranks`, with a fresh id; recovery restarts this session's pool."""
        return RequestWait(pool, self.next_cell_id(), ranks, recover=self._restart_after_failure,
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
        wait = RequestWait(pool, self.next_cell_id(), ranks, recover=self._restart_after_failure,
                           ask_input=refuse_in_background)
        reform = ReformGroups(generation=secrets.randbits(62), after_release=release_id)
        wait.send(RunCommand(cell_id=wait.cell_id, command=reform))
        try:
            wait.wait_for_replies()
        except RankError as error:
            if error.notes:  # the pool was restarted meanwhile: its note says so
                raise GroupsNotReformed("\n".join(error.notes)) from error
            raise GroupsNotReformed(self._restart_after_failure(
                pool.spec, f"the process groups could not be re-formed ({error})")) from error
        return (f"the process groups were re-formed in place in {time.monotonic() - started:.2f} s: every rank's "
                "variables, model and optimizer state are kept")

    def _restart_after_failure(self, spec: PoolSpec, what_happened: str) -> str:
        """Replace the pool without asking its ranks (they are stuck or dead); the note to show."""
        try:
            keep = self.check_held()
        except PoolHeldError as taken:  # never end a pool another kernel holds now
            return alarm(f"{what_happened}; {taken}")
        self.stop(polite=False, keep_standby=True)
        try:
            self.start(spec, keep)
        except (PoolStartError, UsageMistake) as error:  # say so beside why the old pool went, not instead of it
            return (alarm(f"{what_happened}; all rank state was lost and a new pool did not start: {error}")
                + f"\n`%fsdp2 start {spec.describe()}` tries again")
        kept = self.kept_in_memory()
        if kept:
            return (alarm(f"{what_happened}; the pool was restarted ({spec.describe()}) and its variables were "
                          f"lost, but {kept} is kept in memory") + f"\nto resume from it, {RESTORE_HINT}")
        return (alarm(f"{what_happened}; the pool was restarted ({spec.describe()}) and all rank state was lost")
                + f"\n{RESUME_HINT}")



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


def check_keepable(spec: PoolSpec) -> None:
    """Pools on this host and on Ray hosts can be kept; a Slurm step cannot outlive its job."""
    if spec.placement is not None and spec.placement.engine == "slurm":
        raise KeepRefused("--keep is refused with --slurm: the ranks run in a job step, which ends "
                          "with the allocation's job whatever the kernel does")


def _only_pool_name() -> str:
    names = [pool.name for pool in list_pools()]
    if len(names) == 1:
        return names[0]
    if not names:
        raise NoSuchPool("no kept pool exists on this host (`%fsdp2 start --keep` starts one)")
    raise PoolNameNeeded(f"{len(names)} kept pools exist ({', '.join(names)}); `%fsdp2 attach NAME` picks one")
