"""A long day at the notebook on one pool: mixed cells through a real kernel, and nothing that
grows without bound (tests/support/long_day.py says what a reading takes and what may grow).

A short day of 150 cells runs with the suite (it judges descriptors, threads, files, /dev/shm
and the logs' cap, too few cells to judge resident memory); the long one (marked `soak`,
deselected unless `-m soak`) is part of `make soak`: 2,000 cells on 2 ranks by default, changed
with `--long-day-cells`, `--long-day-ranks` and `--long-day-seed` (tests/conftest.py). Both print
the table of readings; no test judges a time.
"""

from __future__ import annotations

import pytest

from tests.support.long_day import MIX, LongDay, LongDayResult, summary_table, unbounded_growth


def _check(result: LongDayResult) -> None:
    table = summary_table(result)
    print(table)
    assert not result.failures, "\n".join([table, *result.failures])
    assert set(result.kinds_run) == set(MIX), table
    problems = unbounded_growth(result)
    assert not problems, "\n".join([table, *problems])
    assert not result.leftovers, "\n".join([table, *result.leftovers])


def test_a_short_day_of_mixed_cells_leaves_descriptors_threads_and_files_flat(tmp_path):
    _check(LongDay(num_cells=150, warmup_cells=50, every=50, workdir=str(tmp_path)).run())


@pytest.mark.soak
@pytest.mark.timeout(0)  # 2,000 cells take about ten minutes on 2 cores; every cell has a timeout of its own
def test_a_long_day_of_mixed_cells_grows_nothing_without_bound(pytestconfig, tmp_path):
    option = pytestconfig.getoption
    _check(LongDay(num_cells=option("--long-day-cells"), num_ranks=option("--long-day-ranks"),
                   seed=option("--long-day-seed"), workdir=str(tmp_path)).run())
