"""The ranks on this host as processes the OS sees: what state each is in, and ending those that
outlive their pool. A rank is found by (pid, start time), so a reused pid is never taken for it;
a rank on another host is not looked up at all."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable

import psutil

from fsdp2nb.host.process_identity import is_same_process
from fsdp2nb.wire.events import RankReady

logger = logging.getLogger(__name__)


def rank_process_state(info: RankReady | None) -> str:
    """A rank process's state as the OS reports it ("stopped", "running", ...), or "" once it
    has ended; "remote" for a rank on another host, which this host cannot see."""
    if info is not None and info.address:
        return "remote"
    process = _same_process(info) if info is not None else None
    try:
        return process.status() if process is not None else ""
    except psutil.Error:
        return ""


def end_leftover_ranks(ranks: Iterable[RankReady], grace_s: float = 3.0) -> None:
    """Make sure no rank outlives its pool: each leads a session of its own, so ending the
    agent reaches them only through PR_SET_PDEATHSIG, which is not immediate. Left running
    they would hold memory and be found later as orphans."""
    local = [info for info in ranks if not info.address]
    processes = [p for p in map(_same_process, local) if p is not None]
    deadline = time.monotonic() + grace_s
    while (processes := [p for p in processes if _still_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
            logger.warning("fsdp2nb: rank pid %d outlived its agent and was killed", process.pid)


def _same_process(info: RankReady) -> psutil.Process | None:
    """The rank's process, unless its pid now belongs to another process (or to none)."""
    if not is_same_process((info.pid, info.start_time)):
        return None
    try:
        return psutil.Process(info.pid)
    except psutil.Error:
        return None


def _still_running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE  # a zombie is dead, waiting for its reaper
    except psutil.Error:
        return False
