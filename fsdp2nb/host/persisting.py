"""Persisting at the breakpoint: how long the ranks of a kernel that died may take to write its
newest snapshot in host memory to disk, and the mark that says they are at it (no torch).

When a kernel dies, its session's snapshot store (host/memory_store.py) must be freed, but its
ranks are still alive: the host agent gives them up to `FSDP2NB_PERSIST_ON_EXIT_S` seconds to
write the newest snapshot as an ordinary checkpoint (checkpoint/persist_on_exit.py) before it ends
them and frees the store. Meanwhile a mark in the store tells a new kernel's reaper
(pool/reaper.py) to wait for them rather than end them as orphans.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from fsdp2nb.atomic_files import replace_atomically

PERSIST_TIMEOUT_ENV = "FSDP2NB_PERSIST_ON_EXIT_S"
"""Seconds the ranks of a dead kernel get to write its newest snapshot to disk; 0 turns it off.
Read by the host agent, which inherits the kernel's environment when it starts."""
DEFAULT_PERSIST_TIMEOUT_S = 60.0
_MARK = "persisting"
"""In a store: the wall-clock time (seconds) until which its ranks may write it to disk."""
AGENT_GIVES_UP_WITHIN_S = 5.0
"""Once the bound has passed, the agent ends the ranks still writing (SIGTERM, then SIGKILL after
a grace of a few seconds) and logs why: a reaper leaves it this long to do so itself."""


def persist_timeout_s(environ: Mapping[str, str] = os.environ) -> tuple[float, str]:
    """The bound `PERSIST_TIMEOUT_ENV` sets, and a line saying why it was not taken (else "")."""
    text = environ.get(PERSIST_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_PERSIST_TIMEOUT_S, ""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        return DEFAULT_PERSIST_TIMEOUT_S, (f"{PERSIST_TIMEOUT_ENV}={text!r} is not a number of seconds >= 0; "
                                           f"{DEFAULT_PERSIST_TIMEOUT_S:g} s was used (0 turns persisting off)")
    return seconds, ""


def mark_persisting(store: str | os.PathLike, until: float) -> None:
    """Note in `store` that its ranks write it to disk until the wall-clock time `until`."""
    replace_atomically(Path(store) / _MARK, f"{until:.3f}\n".encode())


def persisting_until(store: str | os.PathLike) -> float | None:
    """Until when the ranks of `store` may still write it to disk; None when they are not at it."""
    until = persisting_bound(store)
    return until if until is not None and until > time.time() else None


def persisting_bound(store: str | os.PathLike) -> float | None:
    """The wall-clock time its mark gave the ranks of `store`, passed or not; None: no mark."""
    try:
        return float((Path(store) / _MARK).read_text())
    except (OSError, ValueError):
        return None
