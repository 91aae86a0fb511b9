"""A pool whose rank died between cells is replaced by the next cell, which says what died."""

from __future__ import annotations

import pytest

from fsdp2nb.errors import PoolBroken, PoolStartError
from fsdp2nb.frontend.session import NotebookSession
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import RankExited
from tests.support.fake_pools import FakePool

SPEC = PoolSpec(devices=("cpu", "cpu"))


def _pool_with_a_dead_rank() -> FakePool:
    pool = FakePool(SPEC)
    pool.exited[1] = RankExited(rank=1, pid=1001, exit_code=None, signal_name="SIGKILL", stderr_tail=())
    pool.state = "broken"
    return pool


class _FailingToStart(FakePool):
    def start(self) -> None:
        raise PoolStartError("rank 0 exited while starting (exit code 1)")


def test_the_next_cell_restarts_a_pool_whose_rank_died_between_cells(capsys):
    dead = _pool_with_a_dead_rank()
    fresh: list[FakePool] = []
    session = NotebookSession(pool_factory=lambda spec: fresh.append(FakePool(spec)) or fresh[-1])
    session.pool = dead
    pool = session.pool_for(None, lambda: SPEC)
    assert fresh and pool is fresh[0] and session.pool is pool
    assert dead.stopped
    said = capsys.readouterr().err
    assert "rank 1 exited, killed by SIGKILL" in said and "while the pool was idle" in said, said
    assert "the pool was restarted (--cpu 2) and all rank state was lost" in said, said


def test_a_pool_that_cannot_be_replaced_says_so_in_one_line(capsys):
    session = NotebookSession(pool_factory=_FailingToStart)
    session.pool = _pool_with_a_dead_rank()
    with pytest.raises(PoolBroken) as raised:
        session.pool_for(None, lambda: SPEC)
    assert "rank 1 exited, killed by SIGKILL" in str(raised.value)
    assert "`%fsdp2 start --cpu 2` tries again" in str(raised.value)
    assert "a new pool did not start: rank 0 exited while starting" in capsys.readouterr().err
