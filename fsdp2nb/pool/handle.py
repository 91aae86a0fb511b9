"""What the notebook side uses of a pool: the `PoolHandle` protocol, which `WorkerPool` implements.

The session, the request wait, background runs, the dashboard's link and `%fsdp2 status` are
written against this protocol alone, so a test drives them with a stand-in that implements it
(tests/support/fake_pools.py), and the type checker holds both to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from fsdp2nb.pool.held_output import HeldOutput
from fsdp2nb.pool.kept.directory import RankWork
from fsdp2nb.pool.kept.holder import KeepOptions, NotedRun
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.profile_analysis import ProfileAnalysis
from fsdp2nb.wire.events import (
    EventMessage,
    RankClock,
    RankExited,
    RankProfile,
    RankReady,
    RankSnapshot,
    RankStacks,
    TaskProgress,
)
from fsdp2nb.wire.requests import ControlMessage

PoolState = Literal["stopped", "starting", "ready", "broken"]
SnapshotListener = Callable[[RankSnapshot | TaskProgress | RankProfile | RankStacks | RankClock | ProfileAnalysis],
                           None]
BusyListener = Callable[[], None]
"""Called when a request to the ranks starts or ends."""
"""Hears a pool's snapshots and progress events, on the thread reading its events."""


class PoolHandle(Protocol):
    """A pool of ranks as the notebook side sees it: its facts, its lifecycle, its messages."""

    spec: PoolSpec
    keep: KeepOptions | None
    """Set for a kept pool, which outlives this kernel (pool/kept/holder.py)."""
    state: PoolState
    broken_reason: str | None
    """Why the pool can run no more cells, besides a rank's exit."""
    log_dir: str
    memory_dir: str
    """The snapshot store of the ranks' Checkpointers (host/memory_store.py); empty: none."""
    ranks: dict[int, RankReady]
    """Each rank as it joined (pid, device, log file)."""
    snapshots: dict[int, RankSnapshot]
    """Each rank's latest snapshot."""
    exited: dict[int, RankExited]
    held_output: HeldOutput
    """What ranks' own threads printed between cells, for the next cell."""
    snapshot_listeners: list[SnapshotListener]
    busy_listeners: list[BusyListener]
    work_at_attach: list[RankWork]
    """A kept pool attached: what each rank ran then; else empty."""

    @property
    def world_size(self) -> int: ...

    @property
    def busy_ranks(self) -> frozenset[int]: ...

    @property
    def busy_since(self) -> dict[int, float]:
        """Rank -> when it started what it runs now (time.time())."""

    @property
    def start_notes(self) -> list[str]: ...

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None: ...

    def stop(self, *, polite: bool = True, keep_memory: bool = False) -> None: ...

    def release(self) -> None:
        """Close this kernel's end without ending the ranks."""

    def detach(self) -> None:
        """Let go of a kept pool: its ranks wait for the next kernel."""

    def check_agent(self) -> bool:
        """Whether the host agent runs (False: the pool is broken)."""

    def held_here(self) -> bool:
        """Whether this kernel still holds the pool (always, for a pool that is not kept)."""

    def holder_note(self) -> str:
        """Who took this kernel's kept pool."""

    # --- requests -----------------------------------------------------------------------------

    def send(self, ranks: int | tuple[int, ...], message: ControlMessage, connect_timeout_s: float = 5.0) -> None: ...

    def next_event(self, timeout_s: float) -> EventMessage | None: ...

    def mark_busy(self, ranks: tuple[int, ...], since: dict[int, float] | None = None) -> None: ...

    def mark_idle(self, ranks: tuple[int, ...]) -> None: ...

    def mark_broken(self, reason: str) -> None: ...

    def wait_for_exit_cause(self, grace_s: float) -> bool: ...

    def rank_process_state(self, rank: int) -> str: ...

    def request_save(self) -> int: ...

    def new_save_request_id(self) -> int: ...

    def note_background_run(self, cell_id: int, execution_count: int | None, name: str | None) -> None: ...

    def noted_background_run(self, cell_id: int) -> NotedRun | None: ...
