"""A short seeded fault campaign: 15 faults of every kind against a real kernel on 2 CPU ranks.

It fails on any fault not recovered from, a checkpoint lost, LATEST naming an incomplete
checkpoint, a pool's process, private directory, socket or shared memory outliving the kernel,
or final model and optimizer state that differ from a fault-free run's. `make soak` runs the
long campaign (benchmarks/soak.py); both print the same table.
"""

from __future__ import annotations

import pytest

from benchmarks.faults import Campaign, summary_table

SEED = 20261201
NUM_FAULTS = 15

KNOWN_DEFECTS: dict[str, str] = {}
"""Fault kinds that fail on main because of defects being fixed elsewhere, with the reason;
empty it once the fixes are merged, so that the campaign must pass in full."""


def test_fifteen_seeded_faults_lose_nothing_and_leave_nothing(tmp_path):
    result = Campaign(seed=SEED, num_faults=NUM_FAULTS, num_ranks=2, workdir=str(tmp_path)).run()
    table = summary_table(result)
    print(table)
    assert len(result.injected) + sum(bool(r.skipped) for r in result.records) == NUM_FAULTS
    failed = result.failures()
    unexpected = [r for r in failed if r.kind not in KNOWN_DEFECTS]
    assert not unexpected, "\n".join([table, *(f"fault {r.number} {r.kind}: {r.problems}" for r in unexpected)])
    assert not result.orphans, table
    assert result.state_matches, table
    if failed:
        reasons = sorted({f"{r.kind}: {KNOWN_DEFECTS[r.kind]}" for r in failed})
        pytest.xfail(f"known defects (seed {SEED}): " + "; ".join(reasons))
