"""The bound on persisting a dead kernel's snapshot, and the mark a new kernel's reaper reads."""

from __future__ import annotations

import time

import pytest

from fsdp2nb.host.persisting import (
    DEFAULT_PERSIST_TIMEOUT_S,
    PERSIST_TIMEOUT_ENV,
    mark_persisting,
    persist_timeout_s,
    persisting_until,
)


def test_the_bound_is_read_from_the_environment():
    assert persist_timeout_s({}) == (DEFAULT_PERSIST_TIMEOUT_S, "")
    assert persist_timeout_s({PERSIST_TIMEOUT_ENV: "2.5"}) == (2.5, "")
    assert persist_timeout_s({PERSIST_TIMEOUT_ENV: "0"}) == (0.0, "")


@pytest.mark.parametrize("text", ["soon", "-1", "nan", "inf"])
def test_a_bad_bound_is_said_in_one_line_and_the_default_used(text):
    seconds, refused = persist_timeout_s({PERSIST_TIMEOUT_ENV: text})
    assert seconds == DEFAULT_PERSIST_TIMEOUT_S
    assert refused.startswith(f"{PERSIST_TIMEOUT_ENV}={text!r} is not a number of seconds >= 0")
    assert "\n" not in refused


def test_the_mark_holds_until_its_time(tmp_path):
    assert persisting_until(tmp_path) is None
    until = time.time() + 60
    mark_persisting(tmp_path, until)
    assert persisting_until(tmp_path) == pytest.approx(until, abs=0.01)
    mark_persisting(tmp_path, time.time() - 1)  # its time is up: a reaper waits no more
    assert persisting_until(tmp_path) is None
