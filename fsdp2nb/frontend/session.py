"""The notebook side of a pool's lifecycle: start, restart, stop, attach to and detach from kept
pools, and recovery when ranks or the host agent died.

One `NotebookSession` lives in the kernel per loaded extension. It owns at most one pool, the
dashboard's link to it, and the `PoolRequests` (frontend/pool_requests.py) that run work on it,
as ipyparallel keeps its Client apart from its View; every magic is one call into one of them.
Where a request finds ranks dead or stuck, the requests hand the pool back here
(`_restart_after_failure`), which replaces it and says what was lost.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp2nb.errors import (
    AttachFailed,
    BackgroundRunActive,
    KeepRefused,
    NoPoolRunning,
    NoSuchPool,
    PoolAlreadyRunning,
    PoolBroken,
    PoolHeldError,
    PoolMismatchError,
    PoolNameNeeded,
    PoolNotKept,
    PoolStartError,
    UsageMistake,
)
from fsdp2nb.frontend.background import BackgroundRun
from fsdp2nb.frontend.errors import alarm
from fsdp2nb.frontend.output import write_to_kernel
from fsdp2nb.frontend.pool_requests import PoolRequests
from fsdp2nb.host import memory_store
from fsdp2nb.host.process_identity import own_process_key
from fsdp2nb.pool.handle import BusyListener, PoolHandle, SnapshotListener
from fsdp2nb.pool.kept.holder import KeepOptions
from fsdp2nb.pool.kept.listing import list_pools
from fsdp2nb.pool.launcher import LocalLauncher, describe_exit
from fsdp2nb.pool.pool import WorkerPool
from fsdp2nb.pool.spec import PoolSpec

if TYPE_CHECKING:
    from fsdp2nb.frontend.dashboard_link import DashboardLink

logger = logging.getLogger(__name__)

RESUME_HINT = ("to resume, run the cells that set up the ranks again (model, optimizer, Checkpointer); "
               "`ckpt.load(\"latest\")` then continues from the last checkpoint saved")
RESTORE_HINT = ("run the cells that set up the ranks again (model, optimizer, Checkpointer on the same "
                "directory): `track()` restores it")


class NotebookSession:
    """Owns the pool of one kernel and its lifecycle; the magics call its methods and those of
    its `requests`."""

    def __init__(self, pool_factory: Callable[[PoolSpec], PoolHandle] | None = None) -> None:
        self.pool: PoolHandle | None = None
        self.launcher: LocalLauncher | None = None
        """Starts this session's pools, and keeps a standby agent for the next (None where
        `pool_factory` was given: that factory launches its own)."""
        if pool_factory is None:
            self.launcher = LocalLauncher()
            pool_factory = self._pool_with_standby
        self._pool_factory = pool_factory
        self.requests = PoolRequests(recover=self._restart_after_failure)
        """Runs cells and other requests on the pool (frontend/pool_requests.py), and the background runs."""
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
        """The snapshot store of this session's pools (host/memory_store.py), made with the first
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
            return pool, self.requests.take_over(pool)

    def detach(self) -> str:
        """Let go of the kept pool: it runs on, for `%fsdp2 attach` in any kernel. Returns its name."""
        with self.lifecycle_lock:
            keep = self.check_held()
            if self.pool is None:
                raise NoPoolRunning("no pool is running, so there is nothing to detach")
            if keep is None:
                raise PoolNotKept("the running pool is not kept: it ends with this kernel "
                                  "(`%fsdp2 start --keep` starts one that outlives it)")
            active = self.requests.background.active
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

    def pool_ready_for_a_cell(self) -> PoolHandle | None:
        """The running pool, where a cell can go to it at once: nothing to start, replace, take
        back or wait for first (`pool_for` and the background runs do those, saying so)."""
        pool = self.pool
        if pool is None or pool.state != "ready" or pool.exited or not pool.held_here() or not pool.check_agent():
            return None
        latest = self.requests.background.latest
        if self.requests.background.active is not None or (latest is not None and latest.unseen_error() is not None):
            return None
        return pool

    # --- recovery ---------------------------------------------------------------------------

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
