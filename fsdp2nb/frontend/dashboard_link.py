"""Connects the session's pool to the dashboard: feeds its model, serves its buttons.

One link per session, which holds it. A daemon thread wakes every REFRESH_S, and AFTER_CHANGE_S
after a request to the ranks starts or ends, takes the snapshots the pool's receiving side queued
for it, updates the model and sets the traits of every view that changed: background work only
sets traits, at most once per BURST_GAP_S. Button handlers run on the thread the click arrived
on (a subshell thread during a busy cell): what they call here is thread-safe (pool.send,
pool.request_save) or refused while a cell runs (load, delete, export).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Protocol

from fsdp2nb.pool.handle import PoolHandle
from fsdp2nb.pool.launcher import describe_exit
from fsdp2nb.widgets.model import DashboardModel, PoolFacts
from fsdp2nb.wire.records import CheckpointStatus
from fsdp2nb.wire.requests import (
    DeleteCheckpoint,
    ExportHF,
    LoadCheckpoint,
    RankCommand,
    ResetPeak,
    RunCommand,
    SaveCheckpoint,
)

if TYPE_CHECKING:
    from fsdp2nb.frontend.pool_requests import PoolRequests
    from fsdp2nb.pool.handle import BusyListener, SnapshotListener


class LinkedSession(Protocol):
    """What the link needs of the session that holds it (`NotebookSession`): its pool, a way to
    restart it, and its requests (the runs, and a way to ask the ranks)."""

    @property
    def pool(self) -> PoolHandle | None: ...

    @property
    def requests(self) -> PoolRequests: ...

    @property
    def lifecycle_lock(self) -> threading.RLock: ...

    def add_snapshot_listener(self, listener: SnapshotListener) -> None: ...

    def add_busy_listener(self, listener: BusyListener) -> None: ...

    def restart(self) -> PoolHandle: ...

logger = logging.getLogger(__name__)

REFRESH_S = 0.5
AFTER_CHANGE_S = 0.1
"""How long after a request starts or ends the panel is refreshed: soon enough that its rows and
header follow the cell, late enough that the cell's reply goes out first."""
BURST_GAP_S = 0.25
"""The least time between refreshes in a burst of short cells: each costs the cells beside it
kernel time."""
_HOW_TO_TRACK = ("no tracked checkpointer: run `ckpt = fsdp2nb.Checkpointer(dir).track(model=..., optimizer=...)` "
                 "on the ranks first")


def _refused(text: str) -> Exception:
    from fsdp2nb.widgets.dashboard import ActionRefused as Refused

    return Refused(text)


class DashboardLink:
    """Feeds one DashboardModel from `session`'s pool; implements the dashboard's Actions. The session
    makes it (`NotebookSession.dashboard_link`) and holds it."""

    def __init__(self, session: LinkedSession) -> None:
        self.session = session
        self.model = DashboardModel()
        self.views: list = []
        self._snapshots: queue.SimpleQueue = queue.SimpleQueue()
        session.add_snapshot_listener(self._snapshots.put)  # once: it hears every pool of the session
        self._busy_changed = threading.Event()
        session.add_busy_listener(self._busy_changed.set)
        self._restarting = False
        self._host_total = _host_memory()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fsdp2nb-dashboard")
        self._thread.start()

    # --- feeding --------------------------------------------------------------------------------

    def _run(self) -> None:
        refreshed_at = 0.0
        while True:
            if self._busy_changed.wait(REFRESH_S):
                time.sleep(max(AFTER_CHANGE_S, refreshed_at + BURST_GAP_S - time.monotonic()))
                self._busy_changed.clear()  # after the pause: what changed during it is shown now
            refreshed_at = time.monotonic()
            try:
                self.tick()
                for view in list(self.views):
                    view.refresh(self.pool_line())
            except Exception:  # the panel must outlive a bad snapshot; the next tick tries again
                logger.exception("fsdp2nb dashboard update failed")

    def tick(self) -> None:
        """Bring the model up to date with the pool (safe from any thread)."""
        pool = self.session.pool
        while True:
            try:
                self.model.observe(self._snapshots.get_nowait())
            except queue.Empty:
                break
        self.model.set_facts(self._facts(pool))

    def _facts(self, pool: PoolHandle | None) -> PoolFacts:
        if pool is None:
            return PoolFacts(state="starting" if self._restarting else "stopped",
                             world_size=self.model.facts.world_size)
        return PoolFacts(
            state=pool.state, world_size=pool.world_size, description=pool.spec.describe(),
            devices={r: info.where() for r, info in pool.ranks.items()},
            pids={r: info.pid for r, info in pool.ranks.items()},
            deaths={r: describe_exit(report) for r, report in pool.exited.items()},
            busy=frozenset(pool.busy_ranks), busy_since=dict(pool.busy_since), host_total_bytes=self._host_total)

    def pool_line(self) -> str:
        facts = self.model.facts
        if facts.state == "stopped":
            return "no pool is running"
        state = "restarting" if self._restarting else "busy" if facts.busy and facts.state == "ready" else facts.state
        line = f"{facts.description} · {state}"
        run = self.session.requests.background.latest
        return f"{line} · {run.summary()}" if run is not None else line

    # --- showing --------------------------------------------------------------------------------

    def text(self) -> str:
        from fsdp2nb.widgets.markup import task_text, text_tables

        self.tick()
        text = text_tables(self.model.rows(), self.model.checkpoint, f"fsdp2nb pool: {self.pool_line()}",
                           self.model.trainer_checkpoints)
        task = self.model.tasks.latest(self.model.facts.world_size)
        return text if task is None else f"{text}\n{task_text(task)}"

    def show(self) -> None:
        """Display a live dashboard, or print the text tables where no widget can render."""
        from IPython.core.getipython import get_ipython
        from IPython.display import display

        text = self.text()
        if getattr(get_ipython(), "kernel", None) is None:  # terminal IPython: no frontend for widgets
            print(text)
            return
        from fsdp2nb.widgets.dashboard import DashboardView

        view = DashboardView(self.model, self)
        view.refresh(self.pool_line())
        self.views.append(view)
        # The text is what nbconvert, nbclient and frontends without widgets show.
        display({"text/plain": text, "application/vnd.jupyter.widget-view+json": {
            "version_major": 2, "version_minor": 0, "model_id": view.root.model_id}}, raw=True)

    def metrics_table(self):  # a DataFrame when pandas is installed, else a list
        """Every logged point (rank, step, time, values) for `%fsdp2 metrics`."""
        self.tick()
        rows = self.model.metrics.rows()
        try:
            import pandas
        except ImportError:
            return rows
        return pandas.DataFrame(rows)

    # --- actions (on the thread the click arrived on) -------------------------------------------

    def stop(self) -> str:
        pool = self._ready_pool()
        if not pool.busy_ranks:
            raise _refused("no cell is running on the ranks")
        run = self.session.requests.background.active
        if run is not None:  # the kernel may be idle: no waiting main thread to take a SIGINT
            run.interrupt()
            return f"stop sent to {run.label}: every rank is interrupted"
        # The stop button's own path: the waiting main thread turns SIGINT into an interrupt of every rank.
        os.kill(os.getpid(), signal.SIGINT)
        return "stop sent: every rank is interrupted"

    def restart(self) -> str:
        lock = self.session.lifecycle_lock
        if not lock.acquire(blocking=False):  # never wait for the main thread: a pool is being (re)started
            raise _refused("the pool is starting or restarting already; wait until it is ready")
        try:
            pool = self.session.pool
            if pool is not None and pool.busy_ranks:
                raise _refused("a cell is running: Stop it first, then Restart")
            if pool is None:
                raise _refused("no pool to restart; start one with `%fsdp2 start --cpu N` or `--gpus N`")
            self._restarting = True
            pool = self.session.restart()
        finally:
            self._restarting = False
            lock.release()
        return f"restarted: {pool.world_size} fresh ranks ({pool.spec.describe()}); rank state was cleared"

    def reset_peak(self) -> str:
        pool = self._ready_pool()
        pool.send(tuple(range(pool.world_size)), ResetPeak(), connect_timeout_s=0)
        return "peak memory readings restarted on every rank"

    def save(self) -> str:
        pool = self._ready_pool()
        self.tick()
        trainer_only = self.model.checkpoint is None and self.model.trainer_checkpoints is not None
        if not trainer_only:
            self._checkpoint_status()
        if pool.busy_ranks:
            if self.model.save_pending:  # a double click is one save
                return f"{self.model.save_text} (asked once already)"
            if trainer_only:  # fsdp2nb.TrainerCallback takes it at the step's end
                self.model.save_requested(pool.request_save(), "save requested: Trainer saves at the end of its next step")
            else:
                self.model.save_requested(pool.request_save())
            return self.model.save_text
        request_id = pool.new_save_request_id()
        self._run_on_ranks(pool, SaveCheckpoint(request_id=request_id))
        done = "saved; the list shows the new step"
        self.model.save_requested(request_id, done)  # served already: the next snapshot names the step
        return done

    def load(self, step: int) -> str:
        pool = self._idle_pool("Load")
        view = self._checkpoint_status()
        if not any(e.step == step and e.valid for e in view.entries):
            raise _refused(f"step {step} is not a complete checkpoint in {view.directory} "
                           f"(complete: {', '.join(str(e.step) for e in view.entries if e.valid) or 'none'})")
        self._run_on_ranks(pool, LoadCheckpoint(target=step))
        return f"loaded step {step}: model, optimizer, RNG and step restored on every rank"

    def delete(self, step: int, latest_confirmed: bool = False) -> str:
        pool = self._idle_pool("Delete")
        view = self._checkpoint_status()
        if step == view.latest_step and not latest_confirmed:
            raise _refused(f"step {step} is LATEST, the one a resume loads: confirm twice to delete it")
        if step == view.saving_step or not any(e.step == step for e in view.entries):
            raise _refused(f"step {step} is not a finished checkpoint in {view.directory}: not deleted")
        self._run_on_ranks(pool, DeleteCheckpoint(step=step))
        if step != view.latest_step:
            return f"deleted step {step}"
        latest = self.model.checkpoint.latest_step if self.model.checkpoint else None
        return f"deleted step {step}; LATEST is now {latest if latest is not None else 'none'}"

    def export(self, path: str) -> str:
        pool = self._idle_pool("Export")
        self._checkpoint_status()
        path = os.path.abspath(os.path.expanduser(path.strip())) if path.strip() else ""
        problem = _unwritable(path)
        if problem:
            raise _refused(problem)
        self._run_on_ranks(pool, ExportHF(path=path))
        return f"exported the model in Hugging Face format to {path}"

    def take_unserved_request(self) -> bool:
        """Whether a save requested during the cell that just ended may still be unserved (the
        ranks decide, collectively); the panel says it is being made now."""
        if not self.model.save_pending:
            return False
        self.model.cell_ended_with_request()
        return True

    # --- checks ---------------------------------------------------------------------------------

    def _ready_pool(self) -> PoolHandle:
        pool = self.session.pool
        if pool is None or pool.state != "ready":
            state = "stopped" if pool is None else pool.state
            raise _refused(f"the pool is {state}: start one with `%fsdp2 start` or `%fsdp2 restart`")
        return pool

    def _idle_pool(self, what: str) -> PoolHandle:
        pool = self._ready_pool()
        if pool.busy_ranks:
            raise _refused(f"{what} acts while the pool is idle: a cell is running")
        return pool

    def _checkpoint_status(self) -> CheckpointStatus:
        self.tick()
        view = self.model.checkpoint
        if view is None:
            raise _refused(_HOW_TO_TRACK)
        return view

    def _run_on_ranks(self, pool: PoolHandle, command: RankCommand) -> None:
        """One of fsdp2nb's commands (worker/commands.py) on every rank; a rank's error becomes
        the panel's line."""
        from fsdp2nb.frontend.errors import RankError

        try:
            self.session.requests.run_request(pool, tuple(range(pool.world_size)),
                                              lambda cell_id: RunCommand(cell_id=cell_id, command=command))
        except RankError as error:
            raise _refused(_first_error(error)) from None
        self.tick()


def _first_error(error: Exception) -> str:
    errors = getattr(error, "errors", None)
    if errors:
        rank, info = errors[0]
        return f"rank {rank}: {info.ename}: {info.evalue}"
    return str(error)


def _unwritable(path: str) -> str | None:
    """Why `path` cannot take an export, or None."""
    if not path:
        return "type a directory to export to"
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot export to {path}: {existing} is a file"
    try:  # a real write: os.access says yes to root on a read-only mount
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"cannot export to {path}: {existing} is not writable ({error.strerror})"
    return None


def _host_memory() -> int:
    import psutil

    return psutil.virtual_memory().total
