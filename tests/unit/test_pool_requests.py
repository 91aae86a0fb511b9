"""Requests to a pool's ranks (frontend/pool_requests.py), against a pool stand-in that replies
with the events it was given."""

from __future__ import annotations

import pytest

from fsdp2nb.errors import InvalidValue, NothingToDebug
from fsdp2nb.frontend.pool_requests import PoolRequests
from fsdp2nb.pool.kept.directory import RankWork
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import CellFinished
from fsdp2nb.wire.requests import PullValue
from tests.support.fake_pools import FakePool

SPEC = PoolSpec(devices=("cpu", "cpu"))


def _never_recover(spec: PoolSpec, what_happened: str) -> str:
    pytest.fail(f"the pool must not be replaced: {what_happened}")


def test_request_ids_go_on_after_those_the_attached_pools_ranks_ran():
    pool = FakePool(SPEC)
    pool.work_at_attach = [RankWork(running_cell_id=None, execution_count=None, last_cell_id=7, since=0.0),
                           RankWork(running_cell_id=None, execution_count=None, last_cell_id=12, since=0.0)]
    requests = PoolRequests(recover=_never_recover)
    assert requests.take_over(pool) is None  # no rank runs anything: nothing to wait for
    assert requests.next_cell_id() == 13  # a reply to an old request is never taken for a new one's


def test_pull_asks_every_rank_and_returns_the_replying_ranks_values():
    pool = FakePool(SPEC, events=[CellFinished(rank=0, cell_id=1, status="ok"),
                                  CellFinished(rank=1, cell_id=1, status="ok", value=b"pickled")])
    values = PoolRequests(recover=_never_recover).pull(pool, "weights", (1,))
    assert values == {1: b"pickled"}
    assert pool.sent == [PullValue(cell_id=1, name="weights", reply_ranks=(1,))]
    assert pool.busy_ranks == frozenset()


def test_debug_refuses_in_one_line_and_sends_nothing_without_a_failed_cell_or_with_a_rank_not_in_the_pool():
    pool = FakePool(SPEC)
    requests = PoolRequests(recover=_never_recover)
    with pytest.raises(NothingToDebug, match="no %%fsdp2 cell has failed yet"):
        requests.debug(pool, None)
    with pytest.raises(InvalidValue, match=r"--rank 2 is not a rank of this pool \(ranks 0-1\)"):
        requests.debug(pool, 2)
    assert pool.sent == []
