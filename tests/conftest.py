"""Options for the whole suite: the settings of `make soak` (the long fault campaign, the long day), the order
and grouping of tests for pytest-xdist workers (`make test` runs two)."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("soak", "the long fault campaign and the long day (tests marked soak: pytest -m soak)")
    group.addoption("--soak-faults", type=int, default=200, help="how many faults to inject (default 200)")
    group.addoption("--soak-ranks", type=int, default=4, help="CPU ranks in the pool (default 4)")
    group.addoption("--soak-seed", type=int, default=0, help="seed of the scheduler; a failure names it")
    group.addoption("--soak-timeout", type=float, default=5.0, help="the pool's collective timeout in seconds")
    group.addoption("--soak-kinds", default="", help="comma-separated fault kinds (default: every kind)")
    group.addoption("--long-day-cells", type=int, default=2000,
                    help="mixed cells of the long session on one pool (default 2000)")
    group.addoption("--long-day-ranks", type=int, default=2, help="CPU ranks of the long session (default 2)")
    group.addoption("--long-day-seed", type=int, default=0, help="seed of the long session's order of cells")


def pytest_configure(config: pytest.Config) -> None:
    faults, ranks = config.getoption("--soak-faults"), config.getoption("--soak-ranks")
    if faults < 1 or ranks < 2:
        raise pytest.UsageError(f"--soak-faults {faults} --soak-ranks {ranks}: need at least 1 fault and 2 ranks")
    cells, day_ranks = config.getoption("--long-day-cells"), config.getoption("--long-day-ranks")
    if cells < 200 or day_ranks < 2:
        raise pytest.UsageError(f"--long-day-cells {cells} --long-day-ranks {day_ranks}: need at least 200 cells "
                                "(a warm-up of 100, then growth to judge) and 2 ranks (one raises)")


FIRST = ("tests/multihost/", "tests/browser/", "tests/notebooks/")
"""The longest groups, started first, so that no worker is left with one of them at the end."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest groups first (a stable sort: within a group, files keep their order)."""
    items.sort(key=lambda item: next((i for i, prefix in enumerate(FIRST) if item.nodeid.startswith(prefix)),
                                     len(FIRST)))


def worker_group(nodeid: str) -> str:
    """What runs on one pytest-xdist worker: the tests of one file, or every test over network
    namespaces (they share one Ray cluster, which starts once)."""
    path = nodeid.split("::")[0]
    return "tests/multihost" if path.startswith("tests/multihost/") else path


if importlib.util.find_spec("xdist") is not None:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """pytest-xdist's scope scheduling with `worker_group` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    def pytest_xdist_make_scheduler(config: pytest.Config, log) -> GroupScheduling:
        return GroupScheduling(config, log)
