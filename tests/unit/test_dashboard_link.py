"""The dashboard's link to the session's pools, fed from threads: one registration, one record."""

from __future__ import annotations

import sys
import threading
import time

from fsdp2nb.frontend.session import NotebookSession
from fsdp2nb.pool.handle import SnapshotListener
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.widgets.model import MetricsHistory
from fsdp2nb.wire.events import RankSnapshot
from fsdp2nb.wire.records import MetricPoint
from tests.support.fake_pools import FakePool

SPEC = PoolSpec(devices=("cpu", "cpu"))


class SlowListPool(FakePool):
    """A started pool whose listener list takes a while to reach, as if every thread that
    reaches for it were switched out right there: the worst moment for a check-then-append."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec, with_ranks=False)

    @property
    def snapshot_listeners(self) -> list[SnapshotListener]:
        time.sleep(0.05)
        return self._listeners

    @snapshot_listeners.setter
    def snapshot_listeners(self, listeners: list[SnapshotListener]) -> None:
        self._listeners = listeners

    def dispatch(self, snapshot: RankSnapshot) -> None:
        """What the pool's receiving thread does with a snapshot."""
        for listener in list(self._listeners):
            listener(snapshot)


def test_threads_after_a_restart_register_the_dashboard_once():
    """Right after a new pool starts, the dashboard's thread, a click's and the main thread all
    bring the link up to date at once: each point a rank logged is recorded once, not per thread."""
    made: list[SlowListPool] = []

    def factory(spec: PoolSpec) -> SlowListPool:
        made.append(SlowListPool(spec))
        return made[-1]

    session = NotebookSession(pool_factory=factory)
    session.start(SPEC)
    start = threading.Barrier(8)

    def bring_up_to_date() -> None:
        start.wait()
        session.dashboard_link().tick()

    threads = [threading.Thread(target=bring_up_to_date) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(made[0].snapshot_listeners) == 1, made[0].snapshot_listeners
    session.restart()  # a fresh pool hears the same link, once
    pool = made[-1]
    assert len(made) == 2 and len(pool.snapshot_listeners) == 1, pool.snapshot_listeners
    point = MetricPoint(step=1, time=0.0, values={"loss": 2.0})
    pool.dispatch(RankSnapshot(rank=0, time=0.0, busy=False, rss_bytes=1, cpu_percent=0.0, metrics=(point,)))
    link = session.dashboard_link()
    link.tick()
    assert link.model.metrics.rows() == [dict(rank=0, step=1, time=0.0, loss=2.0)]


def test_metric_rows_read_while_points_arrive_are_one_moment_of_the_history():
    """`rows()` on the main thread while the dashboard's thread adds points: a consistent
    history's steps have gaps that shrink towards the newest point (each halving widens the
    older half's), so a read that a halving shifted under shows a gap wider than the one before."""
    history = MetricsHistory(max_points=64)
    stop = threading.Event()

    def log_points() -> None:
        step = 0
        while not stop.is_set():
            history.add(0, (MetricPoint(step=step, time=0.0, values={"loss": 1.0}),))
            step += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter will
    writer = threading.Thread(target=log_points)
    writer.start()
    torn: list[list[int]] = []
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not torn:
            steps = [row["step"] for row in history.rows()]
            gaps = [later - earlier for earlier, later in zip(steps, steps[1:], strict=False)]
            torn = [steps for before, after in zip(gaps, gaps[1:], strict=False) if after > before]
    finally:
        stop.set()
        writer.join(10)
        sys.setswitchinterval(interval)
    assert not torn, torn[0]


class _ShownLines:
    """Stands in for a shown panel: the pool lines it was refreshed with."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def refresh(self, pool_line: str) -> None:
        self.lines.append(pool_line)

    def wait_for(self, wanted: str, after: int) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(wanted in line for line in self.lines[after:]):
                return True
            time.sleep(0.01)
        return False


def test_the_panel_is_refreshed_when_a_request_starts_and_ends(monkeypatch):
    """The rows and header follow a cell as it starts and ends, not at the next periodic refresh
    (here an hour away)."""
    from fsdp2nb.frontend import dashboard_link

    monkeypatch.setattr(dashboard_link, "REFRESH_S", 3600.0)
    session = NotebookSession(pool_factory=FakePool)
    session.start(SPEC)
    shown = _ShownLines()
    session.dashboard_link().views.append(shown)
    pool = session.pool
    assert pool is not None
    pool.mark_busy((0, 1))
    assert shown.wait_for("· busy", after=0), shown.lines
    seen = len(shown.lines)
    pool.mark_idle((0, 1))
    assert shown.wait_for("· ready", after=seen), shown.lines
