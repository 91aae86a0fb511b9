"""Options for the whole suite: the long fault campaign's settings (`make soak`)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("soak", "the long fault campaign (tests marked soak: pytest -m soak)")
    group.addoption("--soak-faults", type=int, default=200, help="how many faults to inject (default 200)")
    group.addoption("--soak-ranks", type=int, default=4, help="CPU ranks in the pool (default 4)")
    group.addoption("--soak-seed", type=int, default=0, help="seed of the scheduler; a failure names it")
    group.addoption("--soak-timeout", type=float, default=5.0, help="the pool's collective timeout in seconds")
    group.addoption("--soak-kinds", default="", help="comma-separated fault kinds (default: every kind)")


def pytest_configure(config: pytest.Config) -> None:
    faults, ranks = config.getoption("--soak-faults"), config.getoption("--soak-ranks")
    if faults < 1 or ranks < 2:
        raise pytest.UsageError(f"--soak-faults {faults} --soak-ranks {ranks}: need at least 1 fault and 2 ranks")
