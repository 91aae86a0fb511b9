"""Seeded fault campaigns against a real kernel training on CPU ranks.

A short one, one fault of each of six kinds on 2 ranks, runs with the suite; the long one (marked
`soak`, deselected unless `-m soak`) is `make soak`: 200 faults of all eleven kinds on 4 ranks by
default, changed with `--soak-faults`, `--soak-ranks`, `--soak-seed`, `--soak-timeout` and
`--soak-kinds` (tests/conftest.py). Each fails
on any fault not recovered from, a checkpoint lost, LATEST naming an incomplete checkpoint, a
pool's process, private directory, socket or shared memory outliving the kernel, or final model
and optimizer state that differ from a fault-free run's; both print the same table.
"""

from __future__ import annotations

import pytest

from tests.support.fault_campaign import Campaign
from tests.support.fault_report import FAULT_KINDS, CampaignResult, summary_table

SEED = 20261201
SUITE_KINDS = ("kill_rank", "kill_kernel", "raise_in_collective", "interrupt_twice", "enospc", "truncated_shard")
"""The suite's campaign, one fault of each: the two kinds no other test injects (the stop button
twice, a full disk during a save) and one of each way back (the pool restarted within the cell, a
new kernel, the other ranks interrupted, `load latest` skipping a damaged step). The other five
kinds are each tested alone (tests/kernel/test_process_faults.py, tests/unit/test_checkpoint.py);
`make soak` mixes all eleven, 200 faults on 4 ranks."""
COLLECTIVE_TIMEOUT_S = 15.0
"""Above the pool's interrupt delay plus its restart grace (3 + 5 s): an exception on one rank
then always ends with the others interrupted and the pool restarted. A shorter timeout lets a
collective time out first, which leaves gloo's pairs closed in a pool that is kept (see stop_rank)."""


def _check(result: CampaignResult) -> None:
    table = summary_table(result)
    print(table)
    problems = [f"fault {r.number} {r.kind} ({r.moment}): {r.problems or 'not recovered'} {r.notes}"
                for r in result.failures()]
    assert not problems, "\n".join([table, *problems])
    assert not result.orphans, table
    assert result.state_matches, table


def test_six_seeded_faults_lose_nothing_and_leave_nothing(tmp_path):
    result = Campaign(seed=SEED, num_faults=len(SUITE_KINDS), num_ranks=2, kinds=SUITE_KINDS, workdir=str(tmp_path),
                      collective_timeout_s=COLLECTIVE_TIMEOUT_S).run()
    assert sorted(record.kind for record in result.records) == sorted(SUITE_KINDS)
    _check(result)


@pytest.mark.soak
@pytest.mark.timeout(0)  # 200 faults take about 40 minutes; every cell has a timeout of its own
def test_the_long_campaign_loses_nothing_and_leaves_nothing(pytestconfig):
    option = pytestconfig.getoption
    kinds = tuple(kind for kind in option("--soak-kinds").split(",") if kind) or FAULT_KINDS
    num_faults = option("--soak-faults")
    result = Campaign(seed=option("--soak-seed"), num_faults=num_faults, num_ranks=option("--soak-ranks"),
                      kinds=kinds, collective_timeout_s=option("--soak-timeout")).run()
    assert len(result.records) == num_faults
    _check(result)
