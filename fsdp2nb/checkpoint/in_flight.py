"""Temporary directories of saves in flight in this process, by any checkpointer: the sweep for
abandoned ones (when a checkpointer is made, and before each save) must not take a live one for
a leftover."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from fsdp2nb.checkpoint import layout

logger = logging.getLogger(__name__)

_live: set[Path] = set()
_lock = threading.Lock()


def started(tmp_dir: Path) -> None:
    with _lock:
        _live.add(tmp_dir)


def ended(tmp_dir: Path) -> None:
    with _lock:
        _live.discard(tmp_dir)


def live_in(directory: Path) -> frozenset[str]:
    """The names of the temporary directories in `directory` that saves of this process write."""
    with _lock:
        return frozenset(p.name for p in _live if p.parent == directory)


def sweep(directory: Path) -> None:
    """Clean abandoned temporary directories, sparing those of saves in flight in this process.

    Cleaning only tidies: rank 0 failing at it alone must not fail (and desynchronise) a save."""
    try:
        layout.recover_and_clean(directory, keep_names=live_in(directory))
    except OSError as exc:
        logger.warning("could not clean abandoned temporary directories in %s: %s", directory, exc)
