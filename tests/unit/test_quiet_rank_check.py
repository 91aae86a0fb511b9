"""After a rank failed, the wait asks the others where they are every quarter second. Those asks
must not put off the check for a rank whose process ended without anything reporting it: that
check runs at its own pace, and the cell names the ended rank without first waiting for the
interrupt that follows a failure."""

from __future__ import annotations

import pytest

from fsdp2nb.frontend import released_collectives, request_wait
from fsdp2nb.frontend.errors import RankError
from fsdp2nb.frontend.request_wait import RequestWait
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import CellFinished
from fsdp2nb.wire.records import ErrorInfo
from tests.support.fake_pools import FakePool


class RankOneEnded(FakePool):
    """Rank 1's process is gone and no agent said so (it was stopped, say, then killed)."""

    def rank_process_state(self, rank: int) -> str:
        return "" if rank == 1 else "running"


@pytest.fixture
def short_waits(monkeypatch):
    """The wait's pacing scaled down, keeping the after-error asks more frequent than the check."""
    monkeypatch.setattr(request_wait, "WAITING_REPORT_S", 0.5)
    monkeypatch.setattr(request_wait, "_ACTIVITY_INTERVAL_S", 0.5)
    monkeypatch.setattr(request_wait, "ERROR_GRACE_S", 1.5)
    monkeypatch.setattr(request_wait, "INTERRUPT_GRACE_S", 1.0)
    monkeypatch.setattr(released_collectives, "RELEASE_AFTER_INTERRUPT_S", 0.2)


def test_a_rank_that_ended_unreported_is_named_while_the_others_are_asked_after_a_failure(short_waits):
    failed = CellFinished(rank=0, cell_id=1, status="error", error=ErrorInfo("ValueError", "bad batch", ()))
    pool = RankOneEnded(PoolSpec(devices=("cpu", "cpu")), [failed])
    recovered: list[str] = []

    def recover(spec: PoolSpec, what: str) -> str:
        recovered.append(what)
        return "a new pool was started"

    wait = RequestWait(pool, 1, (0, 1), recover=recover, ask_input=lambda prompt, password: "",
                       reform=lambda: "re-formed")
    with pytest.raises(RankError) as raised:
        wait.wait_for_replies()
    assert recovered == ["the cell could not reach its ranks (rank 1's process ended and nothing reported it)"]
    assert "rank 1's process ended and nothing reported it" in str(raised.value)
    assert wait.progress.interrupted_at is None  # found before the interrupt that follows a failure
