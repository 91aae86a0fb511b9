"""Pool stand-ins for the notebook side's unit tests: each implements `PoolHandle` (pool/handle.py),
so the type checker holds them to what the session, the wait and the dashboard use of a pool."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from fsdp2nb.host.rank_logs import rank_log_path
from fsdp2nb.pool.handle import BusyListener, PoolHandle, PoolState, SnapshotListener
from fsdp2nb.pool.held_output import HeldOutput
from fsdp2nb.pool.kept.directory import RankWork
from fsdp2nb.pool.kept.holder import KeepOptions, NotedRun
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import EventMessage, RankExited, RankReady, RankSnapshot
from fsdp2nb.wire.requests import ControlMessage


class FakePool:
    """A started pool on this host that is not kept: it records what is sent to it and hands out
    the events it was given, in order. Subclasses change what a test needs."""

    def __init__(self, spec: PoolSpec, events: Iterable[EventMessage] = (), *, with_ranks: bool = True) -> None:
        self.spec = spec
        self.keep: KeepOptions | None = None
        self.state: PoolState = "ready"
        self.broken_reason: str | None = None
        self.log_dir = "/logs"
        self.memory_dir = ""
        self.ranks: dict[int, RankReady] = {
            r: RankReady(rank=r, pid=1000 + r, start_time=0.0, device="cpu", hostname="host",
                         log_path=rank_log_path("/logs", r)) for r in range(spec.world_size)} if with_ranks else {}
        self.snapshots: dict[int, RankSnapshot] = {}
        self.exited: dict[int, RankExited] = {}
        self.held_output = HeldOutput()
        self.snapshot_listeners: list[SnapshotListener] = []
        self.busy_listeners: list[BusyListener] = []
        self.work_at_attach: list[RankWork] = []
        self.sent: list[ControlMessage] = []
        self.stopped = False
        self._busy: frozenset[int] = frozenset()
        self._events: deque[EventMessage] = deque(events)

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def busy_ranks(self) -> frozenset[int]:
        return self._busy

    @property
    def busy_since(self) -> dict[int, float]:
        return {}

    @property
    def start_notes(self) -> list[str]:
        return []

    def start(self) -> None:
        pass

    def stop(self, *, polite: bool = True, keep_memory: bool = False) -> None:
        self.stopped = True

    def release(self) -> None:
        pass

    def detach(self) -> None:
        pass

    def check_agent(self) -> bool:
        return True

    def held_here(self) -> bool:
        return True

    def holder_note(self) -> str:
        return "another kernel"

    def send(self, ranks: int | tuple[int, ...], message: ControlMessage, connect_timeout_s: float = 5.0) -> None:
        self.sent.append(message)

    def next_event(self, timeout_s: float) -> EventMessage | None:
        return self._events.popleft() if self._events else None

    def add_event(self, event: EventMessage) -> None:
        self._events.append(event)

    def mark_busy(self, ranks: tuple[int, ...], since: dict[int, float] | None = None) -> None:
        self._busy |= frozenset(ranks)
        for listener in self.busy_listeners:
            listener()

    def mark_idle(self, ranks: tuple[int, ...]) -> None:
        self._busy -= frozenset(ranks)
        for listener in self.busy_listeners:
            listener()

    def mark_broken(self, reason: str) -> None:
        self.state, self.broken_reason = "broken", reason

    def wait_for_exit_cause(self, grace_s: float) -> bool:
        return True

    def rank_process_state(self, rank: int) -> str:
        return "running"

    def request_save(self) -> int:
        return self.new_save_request_id()

    def new_save_request_id(self) -> int:
        return 1

    def note_background_run(self, cell_id: int, execution_count: int | None, name: str | None) -> None:
        pass

    def noted_background_run(self, cell_id: int) -> NotedRun | None:
        return None


def _implements_the_protocol(pool: FakePool) -> PoolHandle:
    return pool  # the type checker's proof that FakePool is a PoolHandle
