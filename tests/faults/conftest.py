"""Options of the session model-checker (tests/faults/test_session_model.py); each has an
environment variable of the same meaning, for runs that do not go through this directory."""

from __future__ import annotations

import argparse

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("session", "the seeded session model-checker (tests/faults/test_session_model.py)")
    group.addoption("--session-seed", type=int, default=None,
                    help="the first seed (env FSDP2NB_SESSION_SEED); a failure names its seed")
    group.addoption("--session-seeds", type=int, default=None,
                    help="seeds of the soak run, from the first (env FSDP2NB_SESSION_SEEDS, default 5)")
    group.addoption("--session-actions", type=int, default=None,
                    help="most actions of one session (env FSDP2NB_SESSION_ACTIONS; soak default 100)")
    group.addoption("--session-examples", type=int, default=None,
                    help="sessions per seed in the soak run (env FSDP2NB_SESSION_EXAMPLES, default 8)")
    group.addoption("--session-shrink", action=argparse.BooleanOptionalAction, default=None,
                    help="replay shorter variants of a failing session and report the shortest that fails "
                         "(default on; env FSDP2NB_SESSION_SHRINK=0 turns it off)")

