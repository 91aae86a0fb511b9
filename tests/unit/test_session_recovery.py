"""How the notebook session ends a request that went wrong, against a pool stand-in."""

from __future__ import annotations

import time

import pytest

from fsdp2nb.errors import PoolStartError
from fsdp2nb.frontend.errors import RankError
from fsdp2nb.frontend.request_wait import INTERRUPT_GRACE_S
from fsdp2nb.frontend.session import NotebookSession
from fsdp2nb.pool.held_output import HeldOutput
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import CellFinished, RankExited, RichOutput, StreamOutput
from fsdp2nb.wire.records import ErrorInfo
from fsdp2nb.wire.requests import PushValues
from tests.support.fake_pools import FakePool

SPEC = PoolSpec(devices=("cpu", "cpu"))


class ScriptedPool(FakePool):
    """Hands out the events it was given, in order; a pool that fails to start where asked."""

    def __init__(self, spec: PoolSpec, events=(), fails_to_start: bool = False) -> None:
        super().__init__(spec, events)
        self._fails_to_start = fails_to_start

    def start(self) -> None:
        if self._fails_to_start:
            raise PoolStartError("rank 1 exited while starting (exit code 1)")


def test_a_rank_returning_as_the_interrupt_deadline_passes_ends_the_cell_normally():
    pool = ScriptedPool(SPEC)
    session = NotebookSession(pool_factory=lambda spec: pytest.fail("the pool must not be replaced"))
    session.pool = pool
    error = ErrorInfo("ValueError", "bad", ("ValueError: bad",))
    wait = session.requests.request_wait(pool, (0, 1))
    progress = wait.progress
    progress.finished[0] = CellFinished(0, wait.cell_id, "error", error)
    progress.errors.append((0, error))
    progress.first_error_at = time.monotonic() - 10
    progress.interrupted_at = time.monotonic() - INTERRUPT_GRACE_S - 1
    pool.add_event(CellFinished(rank=1, cell_id=wait.cell_id, status="ok"))
    with pytest.raises(RankError):  # rank 0's error, once rank 1 returned
        wait.wait_for_replies()
    assert not pool.stopped and progress.running == []


def test_a_failed_restart_after_a_dead_rank_keeps_the_cause_in_the_error():
    died = RankExited(rank=1, pid=123, exit_code=None, signal_name="SIGKILL", stderr_tail=("last words",))
    pool = ScriptedPool(SPEC, events=[died])
    session = NotebookSession(pool_factory=lambda spec: ScriptedPool(spec, fails_to_start=True))
    session.pool = pool
    with pytest.raises(RankError) as raised:
        session.requests.run_request(pool, (0, 1), lambda cell_id: PushValues(cell_id=cell_id, payload=b""))
    text = "\n".join(raised.value._render_traceback_())
    assert "killed by SIGKILL" in text and "last words" in text
    assert "a new pool did not start: rank 1 exited while starting" in text
    assert "%fsdp2 start --cpu 2" in text
    assert pool.stopped and session.pool is None


def _text(piece: StreamOutput | RichOutput) -> str:
    """A stream's text; of a display, the last character of its PNG data (which tells these apart)."""
    return piece.text if isinstance(piece, StreamOutput) else piece.data["image/png"][-1]


def test_output_held_between_cells_keeps_the_newest_part_of_each_rank():
    held = HeldOutput(max_chars=10)
    for text in ("aaaa\n", "bbbb\n", "cccc\n"):
        held.add(StreamOutput(rank=0, cell_id=None, stream="stdout", text=text))
    held.add(StreamOutput(rank=1, cell_id=None, stream="stderr", text="one\n"))
    pieces, dropped_chars, dropped_displays = held.take()
    assert [(p.rank, _text(p)) for p in pieces] == [(0, "bbbb\n"), (0, "cccc\n"), (1, "one\n")]
    assert dropped_chars == {0: 5} and dropped_displays == {}
    assert held.take() == ([], {}, {})


def test_one_print_longer_than_the_limit_keeps_its_end():
    held = HeldOutput(max_chars=4)
    held.add(StreamOutput(rank=0, cell_id=None, stream="stdout", text="0123456789"))
    pieces, dropped_chars, _ = held.take()
    assert [_text(p) for p in pieces] == ["6789"] and dropped_chars == {0: 6}


def test_displays_are_held_by_count_whatever_their_size():
    held = HeldOutput(max_chars=10, max_displays=2)
    for n in range(3):
        held.add(RichOutput(rank=0, cell_id=None, kind="display", data={"image/png": "x" * 1000 + str(n)}))
    held.add(StreamOutput(rank=0, cell_id=None, stream="stdout", text="abcd\n"))
    pieces, dropped_chars, dropped_displays = held.take()
    assert [_text(p) for p in pieces] == ["1", "2", "abcd\n"]
    assert dropped_chars == {} and dropped_displays == {0: 1}


def test_a_cell_started_during_a_panel_restart_gets_the_new_pool():
    """The dashboard's Restart runs on a subshell thread; a cell on the main thread meanwhile
    must wait for the fresh pool instead of starting a second one or using the stopped one."""
    import threading

    from fsdp2nb.frontend.dashboard_link import DashboardLink

    release = threading.Event()
    made: list[ScriptedPool] = []

    class SlowStartPool(ScriptedPool):
        def start(self) -> None:
            release.wait(10)

    def factory(spec):
        made.append(SlowStartPool(spec))
        return made[-1]

    session = NotebookSession(pool_factory=factory)
    session.pool = old = ScriptedPool(SPEC)
    link = DashboardLink(session)
    restarting = threading.Thread(target=link.restart)
    restarting.start()
    while not made:
        time.sleep(0.01)
    got: list = []
    cell = threading.Thread(target=lambda: got.append(session.pool_for(None, lambda: SPEC)))
    cell.start()
    cell.join(0.2)
    assert cell.is_alive() and not got  # waiting for the restart, not starting a pool of its own
    with pytest.raises(Exception, match="starting or restarting already"):
        link.restart()  # a second click while the first is under way
    release.set()
    restarting.join(10)
    cell.join(10)
    assert old.stopped and got == [made[0]] and len(made) == 1
