"""`CollectiveRelease.outcome`: which ranks' KeyboardInterrupts become the one "interrupted" line
after another rank failed, and which are ranks released from a collective."""

from __future__ import annotations

import time

from fsdp2nb.frontend.cell_progress import CellProgress
from fsdp2nb.frontend.released_collectives import CollectiveRelease
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.records import ErrorInfo
from tests.support.fake_pools import FakePool

FAILED = ErrorInfo("ValueError", "bad batch on rank 0", ())


def _outcome(second_error: ErrorInfo, can_reform: bool = True) -> tuple[list, tuple[str, ...], list[str]]:
    """Rank 0 failed, rank 1 was interrupted after it and raised `second_error`. Returns the
    errors shown, the notes under them and each re-forming of the groups."""
    progress = CellProgress(ranks=(0, 1))
    progress.errors = [(0, FAILED), (1, second_error)]
    progress.interrupted_at = time.monotonic()
    progress.interrupted_after_error = True
    progress.last_line = {1: "In[4] line 3: time.sleep(60)"}
    reformed: list[str] = []

    def reform(release_id: int | None) -> str:
        reformed.append("re-formed")
        return "the process groups were re-formed in place"

    release = CollectiveRelease(progress, FakePool(PoolSpec(devices=("cpu", "cpu"))), {0: 1, 1: 1}, 1,
                                reform if can_reform else None)
    errors, notes = release.outcome()
    return errors, notes, reformed


def test_an_interrupt_raised_in_the_ranks_own_code_is_one_line_under_the_cause():
    errors, notes, reformed = _outcome(ErrorInfo("KeyboardInterrupt", "", ()))
    assert errors == [(0, FAILED)]
    assert notes == ("interrupted rank(s) 1: rank 0 failed while they went on (rank 1 at In[4] line 3: "
                     "time.sleep(60))",)
    assert not reformed  # no collective was cut: the groups are whole


def test_an_interrupt_raised_in_a_released_collective_is_a_release_and_the_groups_are_re_formed():
    errors, notes, reformed = _outcome(ErrorInfo("KeyboardInterrupt", "", (), kind="released"))
    assert errors == [(0, FAILED)]
    assert not any(note.startswith("interrupted rank(s)") for note in notes), notes
    assert any(note.startswith("released rank(s) 1") for note in notes), notes
    assert reformed == ["re-formed"]


def test_where_groups_cannot_be_re_formed_every_rank_says_what_it_raised():
    """NCCL pools: a rank pulled out of a wait by the interrupt tells it in its own traceback."""
    interrupted = ErrorInfo("KeyboardInterrupt", "", ())
    errors, notes, _ = _outcome(interrupted, can_reform=False)
    assert errors == [(0, FAILED), (1, interrupted)] and notes == ()
